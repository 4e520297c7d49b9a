-- The C contract loads, and exports exactly what weft.h declares.
describe("weft.internal.ffi", function()
  local wffi = require("weft.internal.ffi")
  local ffi = require("ffi")

  it("loads libweft.so with a matching ABI version", function()
    assert.are.equal(wffi.ABI_VERSION, wffi.C.weft_abi_version())
    assert.is_truthy(wffi.path:match("libweft%.so$"))
  end)

  it("reports dtype sizes", function()
    assert.are.equal(2, tonumber(wffi.C.weft_dtype_size(wffi.C.WEFT_BF16)))
    assert.are.equal(0, tonumber(wffi.C.weft_dtype_size(99)))
  end)

  it("describes the build", function()
    assert.is_truthy(ffi.string(wffi.C.weft_build_info()):match("cuda="))
  end)

  it("exports exactly the functions declared in weft.h", function()
    local lib = os.getenv("WEFT_LIB") or "build/libweft.so"
    local p = io.popen("scripts/check-exports " .. lib .. " src/weft.h 2>&1; echo rc=$?")
    local out = p:read("*a"); p:close()
    assert.is_truthy(out:match("rc=0"), out)
  end)
end)
