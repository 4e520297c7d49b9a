-- Shell snippets from the docs, run so that every command counts.
--
-- `bash -e` alone lets a failing command through when it is not the last of
-- a `&&` list (`weft-topo --dry-run ... && echo valid` printed an error and
-- passed) or of a pipeline. Here a snippet is cut into its statements (a
-- statement ends where `bash -n` finds the text whole: continuation lines,
-- loops, quotes and here-documents stay in one), and the script runs each
-- under `set -e -o pipefail` followed by a check of its status: any
-- statement that ends non-zero stops the script with that status and a line
-- naming it. `a || b` is still the author's choice (its status is b's).
local M = {}

local function whole(text)
  -- a continued line is whole to bash -n at the end of the text
  local tail = text:match("(\\*)$")
  if #tail % 2 == 1 then return false end
  local file = os.tmpname()
  local f = assert(io.open(file, "w"))
  f:write(text, "\n")
  f:close()
  local p = io.popen(("bash -n %s 2>&1; echo \"rc=$?\""):format(file))
  local out = p:read("*a")
  p:close()
  os.remove(file)
  -- an open here-document is only a warning (status 0): any message means not whole
  return out:match("^rc=0%s*$") ~= nil
end

-- The statements of a snippet: { { line = first line (1-based), text = ... } }.
-- Blank and comment-only lines are not statements. A snippet that never
-- becomes whole is returned as one statement (bash then reports its error).
function M.statements(code)
  local out, cur, first = {}, nil, nil
  local n = 0
  for line in (code:gsub("\n$", "") .. "\n"):gmatch("([^\n]*)\n") do
    n = n + 1
    if cur then
      cur = cur .. "\n" .. line
    elseif not line:match("^%s*$") and not line:match("^%s*#") then
      cur, first = line, n
    end
    if cur and whole(cur) then
      out[#out + 1] = { line = first, text = cur }
      cur = nil
    end
  end
  if cur then out[#out + 1] = { line = first, text = cur } end
  return out
end

local function squote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- A bash script running `code` statement by statement with each status
-- checked. where(line) names a statement's place for the message
-- ("docs/guide.md:83").
function M.script(code, where)
  local parts = {
    "set -e -o pipefail",
    "weft_doc_check() { [ \"$1\" -eq 0 ] || { printf '%s\\n' \"$2: exited with status $1\" >&2; exit \"$1\"; }; }",
  }
  for _, s in ipairs(M.statements(code)) do
    local label = ("%s: `%s`"):format(where and where(s.line) or ("line " .. s.line),
                                      s.text:match("^[^\n]*"))
    parts[#parts + 1] = s.text
    parts[#parts + 1] = "weft_doc_check $? " .. squote(label)
  end
  return table.concat(parts, "\n") .. "\n"
end

return M
