-- A fake capture backend for weft.graph_runner on the CPU: "capturing" runs
-- the function once with capturing() true; a "graph" replays by running it
-- again (or, stale = true, does nothing: a broken graph for verify to catch).
-- Host tensors; padding and random fills on the host.
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local C = wffi.C

local M = {}

function M.backend(o)
  o = o or {}
  local B = { name = "fake", cap = false, captured = 0, destroyed = 0, pads = {}, replays = 0 }
  function B.capturing() return B.cap end
  function B.capture(fn, opts)
    for _ = 1, opts.warmup or 0 do fn({ mode = "graph" }) end
    B.cap = true
    local ok, err = pcall(fn, { mode = "graph" })
    B.cap = false
    if not ok then error("weft: graph.capture: captured function failed: " .. tostring(err), 0) end
    B.captured = B.captured + 1
    local g = { alive = true }
    function g.replay()
      if not g.alive then error("replay of a destroyed fake graph", 0) end
      B.replays = B.replays + 1
      if not o.stale then fn({ mode = "graph" }) end
    end
    function g.destroy() if g.alive then g.alive = false; B.destroyed = B.destroyed + 1 end end
    return g
  end
  function B.pad_rows(t, from, to)
    B.pads[#B.pads + 1] = { from, to }
    local row = t.nbytes / t.shape[1]
    ffi.fill(ffi.cast("uint8_t *", t.ptr) + from * row, (to - from) * row, 0)
  end
  function B.fill_rows(t, rows, seed)
    local count = t.numel / t.shape[1] * rows
    wffi.check(C.weft_host_fill_random(t.ptr, count, t:dtype_code(), seed, 0), "fill")
  end
  return B
end

-- out[i][j] = 2 * x[i][j] + i for rows [0, bs) (host f32 tensors {max, cols})
function M.double_rows(x, y, bs)
  local cols = x.shape[2]
  local xp, yp = ffi.cast("float *", x.ptr), ffi.cast("float *", y.ptr)
  for i = 0, bs - 1 do
    for j = 0, cols - 1 do yp[i * cols + j] = 2 * xp[i * cols + j] + i end
  end
end

return M
