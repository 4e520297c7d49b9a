-- docs/guide.md, executed: every fenced block whose info string says `run`
-- is run exactly as printed, from the repository root, with a time limit:
--   ```lua run n=N [gpu] [timeout=S]   a script under scripts/weft-run -n N
--   ```sh run [gpu] [timeout=S] [needs=CMD]   the commands under bash, each
--       statement's status checked (tests/helpers/checked_shell.lua: a failing
--       command before `&&` or inside a pipeline fails the block too)
-- A block must exit 0 (and print no REPL "[rank N] error:"). `gpu` blocks need N CUDA devices (sh blocks: gpus=K, default one)
-- and are pending without; `needs=CMD` blocks are pending when CMD is not
-- installed. Blocks without `run` (none at present) are prose.
local S = require("helpers.spec_util")
local checked = require("helpers.checked_shell")

local ROOT = os.getenv("PWD") or "."
local GUIDE = "docs/guide.md"

local function blocks(text)
  local out, line_no = {}, 0
  local cur
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do
    line_no = line_no + 1
    if cur then
      if line:match("^```%s*$") then
        cur.code = table.concat(cur.lines, "\n") .. "\n"
        out[#out + 1] = cur
        cur = nil
      else
        cur.lines[#cur.lines + 1] = line
      end
    else
      local lang, info = line:match("^```(%w+)%s*(.*)$")
      if lang then
        local b = { lang = lang, info = info, line = line_no, lines = {} }
        b.run = (" " .. info .. " "):find(" run ", 1, true) ~= nil
        b.n = tonumber(info:match("n=(%d+)")) or 1
        b.gpu = (" " .. info .. " "):find(" gpu ", 1, true) ~= nil
        b.gpus = tonumber(info:match("gpus=(%d+)"))   -- devices a sh block needs (default 1)
        b.timeout = tonumber(info:match("timeout=(%d+)")) or 60
        b.needs = info:match("needs=([%w%-_.]+)")
        cur = b
      end
    end
  end
  assert(not cur, GUIDE .. ": a fenced block is not closed (line " .. (cur and cur.line or 0) .. ")")
  return out
end

local function have(cmd)
  local _, rc = S.shell("command -v " .. cmd .. " >/dev/null")
  return rc == 0
end

local function gpus()
  local ok, cuda = pcall(require, "weft.cuda")
  if not ok then return 0 end
  local ok2, n = pcall(cuda.device_count)
  return ok2 and n or 0
end

describe("docs/guide.md: every snippet runs as printed", function()
  local f = assert(io.open(GUIDE))
  local all = blocks(f:read("*a"))
  f:close()

  it("has runnable snippets for every part of the tour", function()
    local lua_runs, sh_runs, gpu_runs = 0, 0, 0
    for _, b in ipairs(all) do
      assert.is_true(b.run, GUIDE .. ":" .. b.line .. ": a snippet without `run` is not tested")
      if b.lang == "lua" then lua_runs = lua_runs + 1 else sh_runs = sh_runs + 1 end
      if b.gpu then gpu_runs = gpu_runs + 1 end
      assert.is_true(b.lang == "lua" or b.lang == "sh", GUIDE .. ":" .. b.line .. ": unknown language " .. b.lang)
    end
    assert.is_true(lua_runs >= 4 and sh_runs >= 4 and gpu_runs >= 1, lua_runs .. "/" .. sh_runs .. "/" .. gpu_runs)
  end)

  for _, b in ipairs(all) do
    local name = ("%s:%d (%s %s)"):format(GUIDE, b.line, b.lang, b.info)
    if b.gpu then name = name .. " #gpu" end
    it(name, function()
      local need = b.lang == "lua" and b.n or b.gpus or 1
      if b.gpu and gpus() < need then
        pending(gpus() == 0 and "no CUDA device" or ("needs " .. need .. " CUDA devices"))
        return
      end
      if b.needs and not have(b.needs) then
        pending(b.needs .. " is not installed")
        return
      end
      local file = os.tmpname()
      local h = assert(io.open(file, "w"))
      if b.lang == "lua" then
        h:write(b.code)
      else
        h:write(checked.script(b.code, function(l) return GUIDE .. ":" .. (b.line + l) end))
      end
      h:close()
      local cmd
      if b.lang == "lua" then
        cmd = ("cd '%s' && timeout -s KILL %d scripts/weft-run -n %d --timeout %d %s"):format(
          ROOT, b.timeout + 10, b.n, b.timeout, file)
      else
        cmd = ("cd '%s' && timeout -s KILL %d bash %s"):format(ROOT, b.timeout, file)
      end
      local out, rc = S.shell(cmd .. " < /dev/null")
      os.remove(file)
      assert.are.equal(0, rc, name .. " printed:\n" .. out)
      -- the REPL answers an error per rank and goes on: an error is a failure here
      assert.is_nil(out:find("%] error: "), name .. " printed:\n" .. out)
    end)
  end
end)
