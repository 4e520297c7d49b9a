-- One rank of tests/unit/async_spec.lua's exit case (weft-run -n 2): 16 host
-- all-reduces of 16 MiB in flight on the group's progress worker, then an
-- error. When the Lua state closes its finalizers run in any order: the
-- tensors' storage and the shm segment must not be freed under the worker
-- (that was a SIGSEGV in about 1 of 6 runs). Every rank must exit 1 with the
-- error, never by a signal.
local weft = require("weft")
local T = weft.tensor
weft.init()
weft.initialize_model_parallel { tp = 2 }
local tp = weft.tp()
local async = require("weft.async")
local pending = {}
for i = 1, 16 do pending[i] = async.all_reduce(tp, T.ones({ 4194304 }, "f32")) end
error("boom: an error with operations in flight")
