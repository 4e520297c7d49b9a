-- Prints "HASH <n> <hash>" of weft_host_reduce's output over random bit
-- patterns (NaNs, infinities, subnormals, ties included): every dtype and
-- op, 1-5 sources, counts with and without vector tails. Run under
-- WEFT_NO_AVX512 / WEFT_NO_AVX2 by tests/unit/reduce_kernels_spec.lua: every
-- kernel copy must give the same bits.
local ffi = require("ffi")
local C = require("weft.internal.ffi").C
local seed = 12345
local function rnd() seed = (seed * 1103515245 + 12345) % 2147483648; return seed end
local h, n_out = 0, 0
for _, dt in ipairs({ { 0, 4 }, { 1, 2 }, { 2, 2 }, { 3, 4 }, { 4, 8 }, { 5, 1 }, { 6, 8 } }) do
  for _, op in ipairs({ 0, 1, 2, 4 }) do
    for _, n in ipairs({ 1, 2, 3, 5 }) do
      for _, count in ipairs({ 1, 7, 63, 64, 100, 1000, 4099 }) do
        local bytes = count * dt[2]
        local srcs = ffi.new("const void *[?]", n)
        local keep = {}
        for j = 0, n - 1 do
          local b = ffi.new("uint8_t[?]", bytes)
          for i = 0, bytes - 1 do b[i] = math.floor(rnd() / 65536) % 256 end
          keep[#keep + 1] = b
          srcs[j] = b
        end
        local d = ffi.new("uint8_t[?]", bytes)
        assert(C.weft_host_reduce(d, srcs, n, count, dt[1], op) == 0)
        for i = 0, bytes - 1 do h = (h * 31 + d[i]) % 4294967291 end
        n_out = n_out + bytes
      end
    end
  end
end
print(("HASH %d %d"):format(n_out, h))
