-- weft.internal.settings — every WEFT_* environment variable weft reads, in one table.
--
-- The table is the source of docs/environment.md (scripts/gen-environment
-- writes it; tests/unit/settings_spec.lua checks the committed file equals it) and
-- of the check weft.init() runs on every rank (M.check_environment):
--   * a variable set to a value its entry does not allow raises
--     `weft: init: WEFT_X="v" is not allowed: <what is>`;
--   * a WEFT_* name no entry has is reported once per job (rank 0, once per
--     process) on stderr, with the closest known name.
-- tests/unit/settings_spec.lua also checks the table against the code: every
-- WEFT_* name the code reads from the environment has an entry, and every
-- entry's `read` files mention its name.
--
-- Fields of an entry:
--   name     the variable
--   type     "int" (decimal integer, min/max), "enum" (one of choices),
--            "flag" (set to 1, or unset), "string" (any text: a path, a host)
--   default  what applies when it is unset (text, for the docs)
--   scope    "setting" (the library's), "launcher" (weft-run sets it for the
--            ranks), "tool" (scripts and benchmarks), "build" (make),
--            "test" (the specs and their helpers only)
--   read     where it is read (files, relative to the repository)
--   doc      what it does
-- Variables named in the environment but not read through it (make
-- variables set inside mk/, constants of weft.h such as WEFT_BF16, include
-- guards) are no settings and have no entry.
local M = {}

local MIB = 1048576

local function I(name, min, max, default, scope, read, doc)
  return { name = name, type = "int", min = min, max = max, default = default, scope = scope,
           read = read, doc = doc }
end
local function E(name, choices, default, scope, read, doc)
  return { name = name, type = "enum", choices = choices, default = default, scope = scope,
           read = read, doc = doc }
end
local function F(name, scope, read, doc)
  return { name = name, type = "flag", default = "unset", scope = scope, read = read, doc = doc }
end
local function S(name, default, scope, read, doc)
  return { name = name, type = "string", default = default, scope = scope, read = read, doc = doc }
end

local B01 = { "0", "1" }
local MAXI = 9007199254740991   -- 2^53 - 1: any count a double holds exactly

M.list = {
  -- world and waits
  I("WEFT_TIMEOUT_MS", 1, 2147483647, "60000", "setting", { "lua/weft/dist.lua", "lua/weft/tools/repl.lua" },
    "the bound of every wait (store, barrier, peer flag), in milliseconds; read by weft.init()"),
  E("WEFT_HOST_BACKEND", { "auto", "shm", "store", "gloo", "hier" }, "auto", "setting", { "lua/weft/dist.lua" },
    "how host tensors travel: auto, or force shm, the store, flat Gloo or hierarchical (docs/nodes.md)"),
  I("WEFT_LOG", 0, 2, "0", "setting", { "src/core/error.c" },
    "logging to stderr: 0 none, 1 life-cycle events (arena, zero-copy, NCCL), 2 more detail"),
  S("WEFT_LIB", "next to the Lua module, then package.cpath", "setting", { "lua/weft/internal/ffi.lua" },
    "path of libweft.so to load"),
  E("WEFT_USE_MQ_BROADCASTER", B01, "0", "setting", { "lua/weft/dist.lua" },
    "1: the TP groups get the message-queue broadcaster (the seed's use_message_queue_broadcaster)"),
  -- policy
  E("WEFT_ALLREDUCE", { "auto", "default", "nccl", "oneshot", "oneshot_flag", "twoshot" }, "default", "setting",
    { "lua/weft/policy.lua" }, "forces the device all_reduce backend of every group (read when weft.policy loads)"),
  E("WEFT_QUICK_ALLREDUCE", { "default", "fp8", "int4", "int8", "off" }, "off", "setting", { "lua/weft/policy.lua" },
    "the quick (compressed) all-reduce for bf16/f16 sums, opt-in (docs/quick-allreduce.md; read at load)"),
  E("WEFT_DETERMINISTIC", { "0", "1", "false", "true", "off", "on" }, "0", "setting", { "lua/weft/policy.lua" },
    "1: device all-reduces give bits that depend only on the row's inputs (docs/policy.md; read at load)"),
  S("WEFT_POLICY_FILE", "$XDG_CONFIG_HOME/weft/policy.lua, else ~/.config/weft/policy.lua", "setting",
    { "lua/weft/internal/policy_file.lua" }, "the tuned policy file weft loads (scripts/weft-tune writes it)"),
  I("WEFT_CUSTOM_AR_MAX_BYTES", 16, MAXI, tostring(64 * MIB), "setting", { "lua/weft/backends/device_backends/setup.lua" },
    "bytes: the largest all_reduce weft's own kernels take; larger ones go to NCCL (read at load)"),
  I("WEFT_FUSION_MAX_TOKENS", 1, MAXI, "2048", "setting", { "lua/weft/backends/device_backends/setup.lua" },
    "the fused all-reduce + RMSNorm workspace's tokens when the caller declares no max_tokens (read at load)"),
  I("WEFT_HIER_MIN_BYTES", 0, MAXI, tostring(MIB), "setting", { "lua/weft/policy.lua" },
    "bytes: from here host all-reduces across nodes go hierarchical (read at load)"),
  I("WEFT_STORE_SMALL_MAX", 0, MAXI, "131072", "setting", { "lua/weft/policy.lua" },
    "bytes: host tensors across nodes up to this size go through the store (read at load)"),
  I("WEFT_HIER_STORE_MAX", 0, MAXI, "131072", "setting", { "lua/weft/backends/host_nodes.lua" },
    "bytes: the hierarchical path's leaders exchange through the store up to this size (read at load)"),
  I("WEFT_SHM_BYTES", 1, MAXI, "the group's SHM_BYTES", "setting",
    { "lua/weft/group/host.lua", "lua/weft/backends/host_nodes.lua", "lua/weft/async/tensor.lua" },
    "bytes of shared memory per rank of a group's shm communicator"),
  -- store
  S("WEFT_STORE_SECRET", "none", "setting", { "src/store/store.c" },
    "shared secret of the store's handshake; set it on every rank when the store listens beyond loopback"),
  I("WEFT_STORE_MAX_CONNS", 0, 2147483647, "0 (the fd limit less 1/8)", "setting", { "src/core/env.c" },
    "connections of every kind the store holds (docs/store.md)"),
  I("WEFT_STORE_MAX_PREAUTH", 1, 2147483647, "256", "setting", { "src/core/env.c" },
    "connections not yet authenticated the store holds at once"),
  I("WEFT_STORE_READ_TIMEOUT_MS", 1, 2147483647, "10000", "setting", { "src/core/env.c" },
    "handshake deadline and the base of a frame's deadline, in milliseconds"),
  I("WEFT_STORE_IDLE_MS", 0, 2147483647, "0 (never)", "setting", { "src/core/env.c" },
    "closes authenticated connections idle this long, in milliseconds"),
  I("WEFT_STORE_MAX_VALUE", 1024, 1099511627776, tostring(256 * MIB), "setting", { "src/store/store_proto.c" },
    "bytes: the largest value the store takes"),
  I("WEFT_STORE_MAX_TOTAL", 0, MAXI, "0 (a quarter of the RAM, at least 1 GiB)", "setting", { "src/core/env.c" },
    "bytes the store holds at once (keys, values, frames being received)"),
  -- host data plane
  E("WEFT_SHM_ZEROCOPY", B01, "1", "setting", { "src/host/shm_zc.c" },
    "0 turns the zero-copy host collectives off"),
  I("WEFT_SHM_ZEROCOPY_MIN", 1, MAXI, "by size (src/host/shm_zc.c)", "setting", { "src/host/shm_zc.c" },
    "bytes: host collectives from this size go zero-copy"),
  I("WEFT_SHM_ZEROCOPY_ROUND", 0, MAXI, "0 (by size)", "setting", { "src/host/shm_zc.c" },
    "bytes per round of a zero-copy collective; 0 chooses by size"),
  I("WEFT_SHM_ONESHOT_MAX", 0, MAXI, "32768", "setting", { "src/host/shm_seg.c" },
    "bytes: shm all-reduces up to this size go one-shot"),
  I("WEFT_SHM_SPIN_US", 0, 100000, "adaptive", "setting", { "src/host/shm_seg.c" },
    "a fixed spin of the shm waits, in microseconds (docs/host-waits.md)"),
  I("WEFT_SHM_YIELD_US", 0, 100000, "adaptive", "setting", { "src/host/shm_seg.c" },
    "a fixed yield phase of the shm waits, in microseconds (0: none)"),
  I("WEFT_MQ_SPIN_US", 0, 100000, "adaptive", "setting", { "src/host/mq.c" },
    "a fixed spin of the message queue's waits, in microseconds"),
  I("WEFT_MQ_CHUNK_BYTES", 1, MAXI, tostring(MIB), "setting", { "src/host/mq.c" },
    "bytes of a message-queue chunk when the caller gives none"),
  I("WEFT_MQ_CHUNKS", 1, 2147483647, "8", "setting", { "src/host/mq.c" },
    "chunks of a message queue when the caller gives none"),
  E("WEFT_HOST_ARENA", B01, "1", "setting", { "src/host/host_arena.c" },
    "0 turns the shared host arena (large host tensors, zero-copy) off"),
  I("WEFT_HOST_ARENA_GB", 1, 1048576, "256", "setting", { "src/host/host_arena.c" },
    "GiB of address space the host arena reserves (halved until the system grants it)"),
  I("WEFT_HOST_ARENA_KEEP_MB", 0, 2147483647, "64", "setting", { "src/host/host_arena.c" },
    "MiB of freed host-arena memory kept resident"),
  F("WEFT_NO_AVX2", "setting", { "src/host/shm_vec_multi.h" }, "1: the host reductions do not use AVX2"),
  F("WEFT_NO_AVX512", "setting", { "src/host/shm_reduce.c" }, "1: the host reductions do not use AVX-512"),
  S("WEFT_GLOO_HOST", "the interface that reaches rank 0", "setting", { "lua/weft/gloo.lua" },
    "the address Gloo binds to (docs/nodes.md)"),
  I("WEFT_GLOO_SMALL_MAX", 0, MAXI, tostring(16 * MIB), "setting", { "src/host/gloo_shim.cc" },
    "bytes: Gloo all-reduces up to this size take weft's small path (0: off)"),
  I("WEFT_GLOO_CHUNK", 4096, MAXI, "61440", "setting", { "src/host/gloo_shim.cc" },
    "bytes of a chunk of the small path's exchanges"),
  I("WEFT_GLOO_HALVING_MIN", 0, MAXI, "262144", "setting", { "src/host/gloo_shim.cc" },
    "bytes: from here the small path reduce-scatters by recursive halving"),
  I("WEFT_GLOO_SPIN_US", 0, 100000, "adaptive", "setting", { "src/host/gloo_shim.cc" },
    "a fixed spin of the small path's socket wait, in microseconds (0 blocks at once)"),
  I("WEFT_GLOO_YIELD_US", 0, 100000, "adaptive", "setting", { "src/host/gloo_shim.cc" },
    "a fixed yield phase of the small path's socket wait, in microseconds"),
  -- async
  I("WEFT_ASYNC_EXIT_MS", 0, 2147483647, "10000", "setting", { "src/async.c" },
    "how long the process's exit waits for the progress workers, in milliseconds"),
  -- CUDA, NCCL, weft's kernels
  I("WEFT_DEVICE", 0, 1024, "LOCAL_RANK modulo the device count", "setting", { "src/cuda/cuda.c" },
    "the CUDA device of this rank"),
  I("WEFT_CUDA_TIMEOUT_MS", 1, 2147483647, "300000", "setting", { "src/cuda/cuda.c" },
    "the bound of every host wait for a stream or event, in milliseconds"),
  S("WEFT_NCCL_LIB", "libnccl.so.2", "setting", { "src/coll/nccl.c" }, "the NCCL library to dlopen"),
  E("WEFT_NCCL_BLOCKING", B01, "1", "setting", { "src/coll/nccl.c" },
    "0: NCCL communicators are created non-blocking (docs/gpu-runtime.md)"),
  E("WEFT_NCCL_CHECK", B01, "0", "setting", { "lua/weft/backends/device_backends/nccl_backend.lua" },
    "1 agrees every NCCL collective first (one host exchange per call): ranks whose calls differ fail at "
    .. "once naming every rank's call, instead of NCCL pairing them"),
  E("WEFT_NCCL_CHECK_POINTERS", B01, "1", "setting", { "src/coll/nccl.c" },
    "0 skips the check that a collective's pointers are device memory"),
  E("WEFT_ALLOW_MULTICAST", B01, "0", "setting", { "src/coll/nccl.c" },
    "1 lets NCCL use NVLink multicast (NVLS); off otherwise"),
  E("WEFT_ALLOW_SHARED_GPU", B01, "0", "setting",
    { "lua/weft/backends/device_backends/setup.lua", "src/coll/fusion_ext.c", "kernels/fused_norm.cu" },
    "1 lets several ranks share a GPU (tests under MPS: docs/gpu-runtime.md)"),
  I("WEFT_AR_TIMEOUT_MS", 1, 2147483647, "the group's timeout", "setting", { "src/coll/allreduce.c" },
    "the bound of weft's all-reduce kernels' waits, in milliseconds"),
  I("WEFT_AR_BLOCKS_PER_SM", 1, 8, "2", "setting", { "src/coll/allreduce.c" },
    "blocks per SM of weft's all-reduce kernels"),
  I("WEFT_AR_LAMPORT_MAX", 1, MAXI, tostring(16 * MIB), "setting", { "src/coll/allreduce.c" },
    "bytes of each Lamport buffer of the all-reduce workspace"),
  I("WEFT_AR_ONESHOT_MAX", 1, MAXI, "by world (src/coll/allreduce.c)", "setting", { "src/coll/allreduce.c" },
    "bytes: auto takes one-shot up to this size"),
  I("WEFT_AR_TWOSHOT_MIN", 1, MAXI, "by world (src/coll/allreduce.c)", "setting", { "src/coll/allreduce.c" },
    "bytes: at 2 ranks, auto takes two-shot from this size"),
  E("WEFT_AR_PDL", B01, "1", "setting", { "src/coll/allreduce.c" },
    "0 launches the all-reduce kernels without programmatic dependent launch"),
  E("WEFT_DEVICE_AGREE", B01, "1", "setting", { "src/coll/devcoll.c" },
    "0 turns off the device kernels' call announcements (a mismatch is then found only at the timeout); "
    .. "for measuring their cost"),
  I("WEFT_FUSION_TIMEOUT_MS", 1, 2147483647, "the group's timeout", "setting",
    { "src/coll/fused_ws.c" }, "the bound of the fused kernels' waits, in milliseconds"),
  I("WEFT_FUSION_ONESHOT_MAX", 1, MAXI, "by world (src/coll/fusion.c)", "setting", { "src/coll/fusion.c" },
    "bytes: the fused all-reduce + RMSNorm takes one-shot up to this size"),
  I("WEFT_FUSION_EXT_ONESHOT_MAX", 1, MAXI, "by world (src/coll/fusion_ext.c)", "setting",
    { "src/coll/fusion_ext.c" }, "bytes: the extended fusions take one-shot up to this size"),
  I("WEFT_FUSION_PUSH_AHEAD", 1, 1048576, "1", "setting", { "kernels/fused_norm.cu" },
    "one-shot rows a block pushes before it consumes its first"),
  E("WEFT_FUSION_CLUSTER", { "0", "1", "2", "4", "8" }, "0 (automatic)", "setting", { "kernels/fused_norm.cu" },
    "forces the one-shot's cluster size (1: no row split across a cluster)"),
  -- launcher
  I("WEFT_NNODES", 1, 1048576, "1", "launcher", { "lua/weft/tools/launcher.lua", "lua/weft/dist.lua" },
    "the number of nodes (weft-run --nnodes sets it for the ranks)"),
  I("WEFT_NODE_RANK", 0, 1048575, "0", "launcher", { "lua/weft/tools/launcher.lua" },
    "this node's index (weft-run --node-rank sets it)"),
  I("WEFT_REPL_PORT", 1, 65535, "set by weft-run --repl", "launcher", { "lua/weft/tools/repl.lua" },
    "the port of the REPL's link between its ranks"),
  E("WEFT_REPL_CHANNEL", { "auto", "mq", "p2p" }, "auto", "tool",
    { "lua/weft/tools/repl.lua", "lua/weft/tools/repl/link.lua" }, "how the REPL sends chunks to its ranks"),
  S("WEFT_REPL_HISTORY", "~/.weft_repl_history", "tool", { "lua/weft/tools/repl/input.lua" },
    "the REPL's history file (empty: none)"),
  E("WEFT_REPL_READLINE", B01, "1", "tool", { "lua/weft/tools/repl/input.lua" },
    "0: the REPL reads lines without libreadline"),
  S("WEFT_LUAJIT", "luajit from PATH", "tool", { "lua/weft/tools/launcher.lua" }, "the interpreter weft-run starts"),
  -- tools and benchmarks
  S("WEFT_MACHINE", "from the device (bench: nvidia-<gpu>[-xN])", "tool",
    { "lua/weft/tools/bench.lua", "bench/moe_local_bench.cu", "bench/ar_bench.cu", "bench/fused_bench.cu" },
    "the machine name benchmarks put in their results files' names"),
  S("WEFT_COMMIT", "git rev-parse --short HEAD", "tool", { "lua/weft/tools/bench.lua", "scripts/bench-host.lua" },
    "the commit benchmarks record"),
  I("WEFT_PROGRESS_FD", 0, 65535, "2 (stderr)", "tool", { "lua/weft/internal/progress.lua", "scripts/weft-tune" },
    "the descriptor long tools write their progress to (weft-tune gives its ranks its terminal as 3)"),
  I("WEFT_DEMO_CALLS", 1, MAXI, "200", "tool", { "scripts/demo.lua" }, "all-reduce calls scripts/demo.lua times"),
  I("WEFT_EAGER_ROUNDS", 1, MAXI, "400", "tool", { "scripts/bench-eager-call.lua" },
    "rounds of scripts/bench-eager-call.lua"),
  S("WEFT_SERVE_DIR", "set by scripts/serve/start", "tool", { "scripts/serve/start", "scripts/serve/worker.lua" },
    "the served demo's working folder"),
  E("WEFT_SERVE_DEVICE", { "cpu", "cuda" }, "cpu", "tool", { "scripts/serve/serve_engine.lua" },
    "the served demo's device (scripts/serve/start --device)"),
  E("WEFT_SERVE_CHANNEL", { "auto", "cpu", "mq" }, "auto", "tool", { "scripts/serve/serve_engine.lua" },
    "how the served demo's front reaches its ranks (scripts/serve/start --channel)"),
  I("WEFT_SERVE_HIDDEN", 1, MAXI, "256", "tool", { "scripts/serve/serve_engine.lua" },
    "the served demo's hidden size"),
  I("WEFT_SERVE_MAX_BATCH", 1, MAXI, "64", "tool", { "scripts/serve/serve_engine.lua" },
    "rows of the served demo's largest batch"),
  E("WEFT_SERVE_DEBUG", B01, "0", "tool", { "scripts/serve/serve_engine.lua" },
    "1: the served demo's debug output (scripts/serve/start --debug)"),
  I("WEFT_SERVE_HEARTBEAT_MS", 1, 2147483647, "min(1000, timeout / 4)", "tool",
    { "scripts/serve/serve_engine.lua" }, "the served demo's heartbeat, in milliseconds"),
  S("WEFT_SERVE_FREE_HOST", "set by scripts/serve/start", "tool", { "scripts/serve/start" },
    "the host scripts/serve/start finds a free port on"),
  S("WEFT_SIM_HOSTS", "set by weft-sim-nodes", "tool", { "scripts/weft-sim-nodes" },
    "the simulated nodes' addresses, comma-separated (docs/nodes.md)"),
  S("WEFT_SIM_NS", "set by weft-sim-nodes", "tool", { "scripts/weft-sim-nodes" },
    "the simulated nodes' network namespaces"),
  S("WEFT_SIM_AGENT", "set by weft-sim-nodes", "tool", { "scripts/weft-sim-nodes" },
    "the command that runs a command on a simulated node"),
  S("WEFT_SIM_HUB", "set by weft-sim-nodes", "tool", { "scripts/weft-sim-nodes" },
    "the hub namespace of the simulated nodes"),
  S("WEFT_DEPS_DIR", ".deps", "tool", { "scripts/gpu-test" }, "where scripts/gpu-test keeps fetched packages"),
  -- build
  E("WEFT_CUDA", B01, "1 where nvcc is found", "build", { "Makefile" }, "0 builds host-only (make, luarocks)"),
  E("WEFT_GLOO", B01, "1 where Gloo's headers are", "build", { "mk/gloo.mk" }, "0 builds without Gloo"),
  -- tests
  I("WEFT_TEST_JOBS", 1, 1024, "1", "test", { "scripts/run-tests" }, "spec files run in parallel lanes"),
  I("WEFT_TEST_GPU_LANES", 1, 64, "2 on 16 or more cores, else 1", "test", { "scripts/run-tests" },
    "GPU lanes of scripts/run-tests -j"),
  S("WEFT_TEST_PENDING", "unset", "test", { "tests/helpers/summary_output.lua" },
    "all: list each skipped test"),
  S("WEFT_TEST_BACKEND", "unset", "test", { "tests/helpers/group_collectives.lua" },
    "the host backend a group spec worker forces"),
  S("WEFT_TEST_MP", "unset", "test", { "tests/helpers/group_layout.lua" }, "the layout a group spec worker builds"),
  S("WEFT_TEST_SAME", "unset", "test", { "tests/helpers/fault_reduce_worker.lua" },
    "1: a fault spec's ranks reduce the same data"),
  S("WEFT_FAKE_DEVICE", "unset", "test", { "tests/helpers/gpu_worker.lua", "scripts/bench-fusion-ext.lua" },
    "1: the specs' pretend GPU (tests/helpers/fake_device.lua)"),
  S("WEFT_NCCL_TEST_STALL", "unset", "test", { "src/coll/nccl.c" },
    "init:<ms> or split:<ms>: this rank sleeps before that phase of NCCL create (docs/gpu-runtime.md)"),
  S("WEFT_AR_BENCH", "unset", "test", { "tests/gpu/gpu_allreduce_spec.lua" }, "the all-reduce harness's run, shared"),
  S("WEFT_FUSED_BENCH", "unset", "test", { "tests/gpu/gpu_fusion_spec.lua" }, "the fused harness's run, shared"),
  S("WEFT_DETERM_ROWS", "8192", "test", { "tests/helpers/gpu_determ_worker.lua" }, "rows of the determinism worker"),
  S("WEFT_QUICK_ENV_ONLY", "unset", "test", { "tests/helpers/quick_ranks.lua" }, "quick policy worker mode"),
  S("WEFT_MISMATCH_CASES", "unset", "test", { "tests/helpers/gpu_mismatch_worker.lua" },
    "comma-separated cases the device mismatch spec's worker runs (all when unset)"),
  S("WEFT_MISMATCH_WARM", "unset", "test", { "tests/helpers/gpu_mismatch_worker.lua" },
    "1: each device mismatch case after a matching warm-up call (the mismatch's time alone)"),
  S("WEFT_QUICK_KILL", "unset", "test", { "tests/helpers/gpu_quick_worker.lua" }, "the rank a quick spec kills"),
  S("WEFT_QUICK_NO_KILL", "unset", "test", { "tests/gpu/gpu_quick_spec.lua" }, "1 skips the quick spec's kill test"),
  S("WEFT_QUICK_WORLDS", "2 4 6 8", "test", { "tests/gpu/gpu_quick_spec.lua" }, "worlds of the quick GPU spec"),
  S("WEFT_QUICK_SNR", "unset", "test", { "tests/unit/quick_codec_spec.lua" }, "set: print the codecs' SNR table"),
  S("WEFT_SHARED_KILL", "unset", "test", { "tests/helpers/gpu_shared_worker.lua" }, "the rank a shared-GPU spec kills"),
  S("WEFT_ROOT", ".", "test", { "tests/helpers/serve_gpu_ranks.lua" }, "the repository, for a spec's ranks"),
}

M.by_name = {}
for _, e in ipairs(M.list) do
  assert(not M.by_name[e.name], e.name)
  M.by_name[e.name] = e
end

-- allowed(e) -> text: what the entry allows
function M.allowed(e)
  if e.type == "int" then
    if e.max and e.max < MAXI then return ("an integer from %d to %d"):format(e.min, e.max) end
    return ("an integer >= %d"):format(e.min)
  elseif e.type == "enum" then
    return "one of " .. table.concat(e.choices, ", ")
  elseif e.type == "flag" then
    return "1 (or unset)"
  end
  return "any text"
end

-- problem(name, value) -> nil when fine, else the message (without "weft: op: ")
-- A name without an entry is fine here (M.unknown says so); an empty value is unset.
function M.problem(name, value)
  local e = M.by_name[name]
  if not e or value == nil or value == "" then return nil end
  local ok = true
  if e.type == "int" then
    local n = value:match("^%s*[+-]?%d+%s*$") and tonumber(value)
    ok = n ~= nil and n >= e.min and (e.max == nil or n <= e.max)
  elseif e.type == "enum" then
    ok = false
    for _, c in ipairs(e.choices) do if c == value then ok = true end end
  elseif e.type == "flag" then
    ok = value == "1"
  end
  if ok then return nil end
  return ("%s=%q is not allowed: it takes %s (docs/environment.md)"):format(name, value, M.allowed(e))
end

local function distance(a, b)
  local la, lb = #a, #b
  local prev, cur = {}, {}
  for j = 0, lb do prev[j] = j end
  for i = 1, la do
    cur[0] = i
    local ca = a:byte(i)
    for j = 1, lb do
      local cost = ca == b:byte(j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev, cur = cur, prev
  end
  return prev[lb]
end
M.distance = distance

-- closest(name) -> the known name nearest to it, or nil when none is near:
-- an edit distance of at most a third of the part after WEFT_ (at least 1),
-- else a known name that begins with it (WEFT_TIMEOUT -> WEFT_TIMEOUT_MS)
function M.closest(name)
  local best, bd
  for _, e in ipairs(M.list) do
    local d = distance(name, e.name)
    if bd == nil or d < bd then best, bd = e.name, d end
  end
  local tail = #name - #"WEFT_"
  if bd and bd <= math.max(1, math.floor(tail / 3)) then return best end
  for _, e in ipairs(M.list) do
    if e.name:sub(1, #name) == name and #name > #"WEFT_" + 2 then return e.name end
  end
  return nil
end

-- unknown(name) -> nil for a known name, else the warning line
function M.unknown(name)
  if M.by_name[name] then return nil end
  local c = M.closest(name)
  return ("weft: warning: %s is not a weft setting (ignored)%s; docs/environment.md lists them")
    :format(name, c and ("; did you mean " .. c .. "?") or "")
end

-- environ() -> { {name, value}, ... } of every WEFT_* variable set
function M.environ()
  local ffi = require("ffi")
  if not pcall(function() return ffi.C.environ end) then
    pcall(ffi.cdef, "extern char **environ;")
  end
  local out = {}
  local ok, env = pcall(function() return ffi.C.environ end)
  if not ok or env == nil then return out end
  local i = 0
  while env[i] ~= nil do
    local s = ffi.string(env[i])
    local k, v = s:match("^(WEFT_[^=]*)=(.*)$")
    if k then out[#out + 1] = { k, v } end
    i = i + 1
  end
  table.sort(out, function(a, b) return a[1] < b[1] end)
  return out
end

local warned = false

-- check_environment([opts]): raises on the first WEFT_* variable set to a
-- value its entry does not allow (every rank); warns on stderr about the
-- WEFT_* names no entry has, once per process, on rank 0 only (RANK unset
-- or 0), so a job warns once.
--   opts.op (default "init"), opts.vars (default M.environ()),
--   opts.warn(line) (default: a line on stderr), opts.rank
function M.check_environment(opts)
  opts = opts or {}
  local vars = opts.vars or M.environ()
  local op = opts.op or "init"
  for _, kv in ipairs(vars) do
    local msg = M.problem(kv[1], kv[2])
    if msg then error(("weft: %s: %s"):format(op, msg), 0) end
  end
  local rank = opts.rank
  if rank == nil then rank = tonumber(os.getenv("RANK") or "") or 0 end
  if warned or rank ~= 0 then return end
  warned = true
  local warn = opts.warn or function(line) io.stderr:write(line, "\n") end
  for _, kv in ipairs(vars) do
    local line = M.unknown(kv[1])
    if line then warn(line) end
  end
end

local SCOPES = {
  { "setting", "Settings of the library", "Read by weft itself; checked at `weft.init()` on every rank." },
  { "launcher", "Set by the launcher", "`scripts/weft-run` sets these for the ranks; checked like the settings." },
  { "tool", "Tools and benchmarks", "Read by the scripts in `scripts/` and the harnesses in `bench/`; checked at `weft.init()` too." },
  { "build", "Build", "Read by `make` (and `luarocks make`) from the environment or its command line." },
  { "test", "Tests only", "Read by the specs in `tests/` and `scripts/run-tests`; no user sets them. Free-form ones are not checked." },
}

local function esc(s) return (tostring(s):gsub("|", "\\|")) end

-- markdown() -> the text of docs/environment.md
function M.markdown()
  local out = {
    "# Environment variables",
    "",
    "<!-- generated from lua/weft/internal/settings.lua by scripts/gen-environment: do not edit -->",
    "",
    "Every `WEFT_*` variable weft, its tools and its tests read. The table lives in",
    "[`lua/weft/internal/settings.lua`](../lua/weft/internal/settings.lua); this page is generated from it",
    "(`scripts/gen-environment > docs/environment.md`) and `tests/unit/settings_spec.lua` checks",
    "that the two agree and that every `WEFT_*` name the code reads has an entry.",
    "",
    "`weft.init()` checks every `WEFT_*` variable set, on every rank: a value the table",
    "does not allow raises `weft: init: WEFT_X=\"v\" is not allowed: it takes ...`,",
    "and a `WEFT_*` name the table does not know is reported once on stderr (by rank 0),",
    "with the closest known name (`WEFT_QUICK_ALLREDUC` → did you mean `WEFT_QUICK_ALLREDUCE`?).",
    "An empty value counts as unset. Variables read when a module loads (marked \"read at",
    "load\") keep their own check there too: a bad `WEFT_ALLREDUCE` fails the calls it steers.",
    "",
    "Names that are not environment variables (constants of `weft.h` such as `WEFT_BF16`,",
    "make variables set inside `mk/` such as `WEFT_TOOLS`) have no entry.",
  }
  for _, sc in ipairs(SCOPES) do
    out[#out + 1] = ""
    out[#out + 1] = "## " .. sc[2]
    out[#out + 1] = ""
    out[#out + 1] = sc[3]
    out[#out + 1] = ""
    out[#out + 1] = "| variable | allowed | default | what it does | read in |"
    out[#out + 1] = "|---|---|---|---|---|"
    for _, e in ipairs(M.list) do
      if e.scope == sc[1] then
        -- plain text: a `scripts/...` span in a table row reads as a command to run
        out[#out + 1] = ("| `%s` | %s | %s | %s | %s |"):format(e.name, esc(M.allowed(e)), esc(e.default),
                                                             esc(e.doc), table.concat(e.read, ", "))
      end
    end
  end
  return table.concat(out, "\n") .. "\n"
end

function M._reset_warned() warned = false end

return M
