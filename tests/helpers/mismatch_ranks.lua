-- One rank of tests/faults/fault_mismatch_spec.lua (issue 36): a matrix of calls
-- in which rank 1 differs from the others (dtype, op, count, shape, root,
-- kind, an object that cannot be serialized). For each case every rank
-- prints
--   CASE <name> <ERR|OK> <ms> <message>
-- then checks that the group still works (an all_reduce of ones):
--   AFTER <name> <ok|message>
-- Usage: luajit mismatch_ranks.lua [case ...]   (default: every case)
local weft = require("weft")
local T = weft.tensor
local w = weft.init()
local r = w.rank
local odd = r == 1

local CASES = {
  { "dtype_width", function() w:all_reduce(T.full({ 8 }, 1, odd and "f32" or "f16")) end },
  { "dtype_same_width", function() w:all_reduce(T.full({ 8 }, 1, odd and "f16" or "bf16")) end },
  { "op", function() w:all_reduce(T.full({ 8 }, 1, "f32"), odd and "max" or "sum") end },
  { "count", function() w:all_reduce(T.full({ odd and 16 or 8 }, 1, "f32")) end },
  { "count_large", function() w:all_reduce(T.full({ odd and 32768 or 16384 }, 1, "f32")) end },
  { "shape", function() w:all_reduce(T.full(odd and { 2, 4 } or { 8 }, 1, "f32")) end },
  { "shape_gather", function() w:all_gather(T.full(odd and { 4, 2 } or { 2, 4 }, 1, "f32"), 0) end },
  { "shape_5d", function() w:all_reduce(T.full(odd and { 1, 2, 1, 2, 2 } or { 2, 1, 2, 1, 2 }, 1, "f32")) end },
  -- the same bytes and shapes, other sizes tables (each rank's own entry right)
  { "gatherv_sizes", function()
      local sizes = w.world_size == 2 and (odd and { 3, 2 } or { 2, 3 }) or nil
      if not sizes then
        sizes = {}
        for i = 1, w.world_size do sizes[i] = 2 end
        sizes[odd and 1 or 2] = 3
        if r == 0 then sizes[1] = 2 end
        if r == 1 then sizes[2] = 2 end
      end
      w:all_gatherv(T.full({ 2, 4 }, r + 1, "f32"), sizes)
    end },
  -- a reduction the shm engine does not do itself (u8: gathered, reduced here)
  { "op_u8", function() w:all_reduce(T.full({ 8 }, 1, "u8"), odd and "max" or "sum") end },
  -- every rank of the second node differs (the hierarchy's node leaders meet)
  { "node_dtype", function()
      w:all_reduce(T.full({ 8 }, 1, (w.node_index or 0) > 0 and "f16" or "bf16"))
    end },
  { "gather_count", function() w:all_gather(T.full({ odd and 16 or 8 }, 1, "f32"), 0) end },
  { "gather_root", function() w:gather(T.full({ 8 }, r, "f32"), odd and 1 or 0) end },
  -- the same tensor, other sizes tables summing to its rows (reduced whole,
  -- then split: only the sizes tell the calls apart)
  { "rsv_sizes", function()
      local n = w.world_size
      local sizes = {}
      for i = 1, n do sizes[i] = 2 end
      if odd then sizes[1], sizes[2] = 1, 3 end
      w:reduce_scatterv(T.full({ 2 * n, 4 }, r + 1, "f32"), nil, sizes)
    end },
  { "broadcast_root", function() w:broadcast(T.full({ 8 }, r, "f32"), odd and 1 or 0) end },
  { "broadcast_count", function() w:broadcast(T.full({ odd and 16 or 8 }, r, "f32"), 0) end },
  -- the barrier as a fresh group's first call (no shm or Gloo communicator yet)
  { "barrier_first_call", function()
      local ranks = {}
      for i = 1, w.world_size do ranks[i] = i - 1 end
      local g = weft.create_custom_group(ranks)
      local ok, err = pcall(function()
        if odd then g:barrier() else g:all_reduce(T.full({ 8 }, 1, "f32")) end
      end)
      g:destroy()
      if not ok then error(err, 0) end
    end },
  { "barrier_vs_all_reduce", function()
      if odd then w:barrier() else w:all_reduce(T.full({ 8 }, 1, "f32")) end
    end },
  -- all_to_all_single: rows per rank; split tables whose rows do not add up
  -- (each rank's own table valid); splits against the even form
  { "a2a_rows", function()
      local W = w.world_size
      local n = odd and 2 * W or W
      w:all_to_all_single(T.zeros({ n, 2 }, "f32"), T.full({ n, 2 }, r, "f32"))
    end },
  { "a2a_splits", function()
      local W, s = w.world_size, {}
      for i = 1, W do s[i] = 1 end
      if odd then s[1], s[2] = 2, 0 end
      w:all_to_all_single(T.zeros({ W, 2 }, "f32"), T.full({ W, 2 }, r, "f32"), s)
    end },
  { "a2a_splits_vs_even", function()
      local W, s = w.world_size, {}
      for i = 1, W do s[i] = 1 end
      w:all_to_all_single(T.zeros({ W, 2 }, "f32"), T.full({ W, 2 }, r, "f32"), odd and s or nil)
    end },
  { "object_unserializable", function()
      w:all_gather_object(odd and { f = function() end } or { 1 })
    end },
  { "object_kind", function()
      if odd then w:broadcast_object(1, 0) else w:all_gather_object(1) end
    end },
  -- an object collective (over the store) against a tensor collective on a
  -- group whose host collectives are warm on shm
  { "object_vs_all_reduce", function()
      w:all_reduce(T.full({ 8 }, 1, "f32"))
      if odd then w:broadcast_object(1, 0) else w:all_reduce(T.full({ 8 }, 1, "f32")) end
    end },
  -- the same through weft.async (its worker passes the same barrier)
  { "object_async_vs_all_reduce", function()
      w:all_reduce(T.full({ 8 }, 1, "f32"))
      if odd then require("weft.async").broadcast_object(w, 1, 0):wait()
      else w:all_reduce(T.full({ 8 }, 1, "f32")) end
    end },
}

local want = {}
for i = 1, #arg do want[arg[i]] = true end
local now_ms = require("weft.internal.clock").now_ms
for _, c in ipairs(CASES) do
  local name, f = c[1], c[2]
  if next(want) == nil or want[name] then
    local t0 = now_ms()
    local ok, err = pcall(f)
    io.stdout:write(("CASE %s %s %.1f %s\n"):format(name, ok and "OK" or "ERR", now_ms() - t0,
                                                    tostring(err):gsub("\n", " | ")))
    local x = T.full({ 4 }, 1, "f32")
    local aok, aerr = pcall(w.all_reduce, w, x)
    local good = aok and x:to_table()[1] == w.world_size
    io.stdout:write(("AFTER %s %s\n"):format(name, good and "ok" or tostring(aerr):gsub("\n", " | ")))
    io.stdout:flush()
  end
end
weft.shutdown()
