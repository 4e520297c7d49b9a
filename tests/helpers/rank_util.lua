-- The rank side of the multi-process specs (tests/helpers/*_worker.lua): the
-- rank's environment, output lines, counted checks, timed reports and killing
-- this process. Lines: "FAIL rank R: ...", "<WHAT> ok=<bool> ms=<n> msg=<text>",
-- "OK rank R checks=K" (what tests/helpers/spec_util.lua reads back).
local ffi = require("ffi")
local util = require("helpers.store_util")

local W = {}

if not pcall(ffi.typeof, "wrk_marker") then
  ffi.cdef [[
  typedef struct { int unused; } wrk_marker;
  int wrk_kill(int pid, int sig) __asm__("kill");
  int wrk_getpid(void) __asm__("getpid");
  ]]
end
local C = ffi.C

-- RANK, WORLD_SIZE, MASTER_PORT (set by weft-run or util.run_ranks)
function W.env()
  return assert(tonumber(os.getenv("RANK")), "RANK"),
         assert(tonumber(os.getenv("WORLD_SIZE")), "WORLD_SIZE"),
         assert(tonumber(os.getenv("MASTER_PORT")), "MASTER_PORT")
end

-- A worker's rank, world size, store port (W.env) and its scenario from the
-- environment: <PREFIX>_MODE (default `mode`) and <PREFIX>_TIMEOUT_MS
-- (default `timeout_ms`): rank, n, port, mode, timeout_ms.
function W.start(prefix, mode, timeout_ms)
  local rank, n, port = W.env()
  return rank, n, port, os.getenv(prefix .. "_MODE") or mode,
         tonumber(os.getenv(prefix .. "_TIMEOUT_MS") or "") or timeout_ms
end

-- The store of a worker's world, served by rank 0 on 127.0.0.1:port, and the
-- list of the world's ranks {0, ..., n - 1}: s, all.
function W.world_store(rank, n, port, timeout_ms)
  local s = require("weft.store").open { host = "127.0.0.1", port = port, server = rank == 0,
                                         timeout_ms = timeout_ms }
  local all = {}
  for r = 0, n - 1 do all[r + 1] = r end
  return s, all
end

function W.say(s) io.stdout:write(s, "\n"); io.stdout:flush() end
local say = W.say

-- "<WHAT> ok=<bool> ms=<since t0> msg=<msg on one line>"
function W.report(what, ok, t0, msg)
  say(("%s ok=%s ms=%d msg=%s"):format(what, tostring(ok), util.now_ms() - t0,
                                        (tostring(msg):gsub("\n", " "))))
end

-- Counted checks of one rank: K.check(cond, fmt, ...) prints a FAIL line and
-- returns cond; K.ok_line() prints the OK line if nothing failed; K.exit()
-- exits 0 or 1 accordingly.
function W.checker(rank)
  local K = { checks = 0, failures = 0 }
  function K.check(cond, fmt, ...)
    K.checks = K.checks + 1
    if not cond then
      K.failures = K.failures + 1
      say(("FAIL rank %d: " .. fmt):format(rank, ...))
    end
    return cond
  end
  function K.ok_line()
    if K.failures == 0 then say(("OK rank %d checks=%d"):format(rank, K.checks)) end
  end
  function K.exit() os.exit(K.failures == 0 and 0 or 1) end
  return K
end

-- The checks of the helpers that print "OK <name>" per check and raise on a
-- failed one (a non-zero exit): W.ok(name) prints the line; W.must(cond, msg)
-- raises "check failed: <msg>" naming its caller's line; W.expect_error(fn,
-- wants, what) runs fn, which must raise an error containing every string of
-- `wants`, and returns that error.
function W.ok(name) io.stdout:write("OK ", name, "\n"); io.stdout:flush() end

function W.must(cond, msg) if not cond then error("check failed: " .. msg, 2) end end
local must = W.must

function W.expect_error(fn, wants, what)
  local good, err = pcall(fn)
  must(not good, what .. ": expected an error")
  err = tostring(err)
  for _, w in ipairs(wants) do
    must(err:find(w, 1, true) ~= nil, ("%s: error %q lacks %q"):format(what, err, w))
  end
  return err
end

-- SIGKILL this process (a rank that dies without cleaning up)
function W.kill_self() C.wrk_kill(C.wrk_getpid(), 9) end

return W
