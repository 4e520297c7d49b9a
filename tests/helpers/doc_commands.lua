-- The commands a markdown page tells its reader to type, for specs that run
-- them as written (tests/unit/readme_commands_spec.lua).
--
-- The rule (so that whoever edits the page knows what gets run):
--   * a line of a code block (fenced with ``` or ~~~ and tagged sh, bash,
--     shell, console or untagged; or indented by 4 spaces) that starts with
--     `scripts/` or `make ` (a leading "$ " prompt is dropped, and so is a
--     trailing "  # comment");
--   * an inline code span `scripts/...` or `make ...` in a table row (a line
--     starting with "|"; "\|" in it is "|"; a bare folder such as `scripts/`
--     is not a command). Spans in running text are mentions ("`scripts/weft-run
--     -n 4` starts 4 ranks"), not commands, and are not run;
--   * a ```lua block whose first line is a comment naming the command that
--     runs it: "-- scripts/weft-run -n 4 my_experiment.lua" (or "-- run
--     with: ..."): the block is the file named by the command's last *.lua
--     word, and runs beside it.
-- A command is listed once (its first place). Returns an array of
-- { cmd = "...", line = N, kind = "block" | "span" | "script", file = name,
--   text = the lua block }.
local M = {}

local SHELL_TAGS = { [""] = true, sh = true, bash = true, shell = true, console = true }

local function trim(s) return (s:gsub("^%s+", ""):gsub("%s+$", "")) end

local function is_command(s)
  if s:match("^%S+/$") then return false end   -- `scripts/`: a folder, not a command
  return s:sub(1, 8) == "scripts/" or s:sub(1, 5) == "make "
end

-- a shell line as a command, or nil
local function shell_command(line)
  local s = trim(line):gsub("^%$%s+", "")
  if not is_command(s) then return nil end
  s = s:gsub("%s+#.*$", "")   -- "make demo    # the main job"
  return trim(s)
end

function M.extract(text)
  local out, seen = {}, {}
  local function add(c)
    if c.cmd and c.cmd ~= "" and not seen[c.cmd] then
      seen[c.cmd] = true
      out[#out + 1] = c
    end
  end
  local lines = {}
  for l in (text .. "\n"):gmatch("([^\n]*)\n") do lines[#lines + 1] = l end
  local i, prev_blank = 1, true
  while i <= #lines do
    local l = lines[i]
    local fence, tag = l:match("^%s*(```+)%s*([%w_+-]*)")
    if not fence then fence, tag = l:match("^%s*(~~~+)%s*([%w_+-]*)") end
    if fence then
      local body, start = {}, i
      i = i + 1
      while i <= #lines and not lines[i]:match("^%s*" .. fence:sub(1, 1):rep(3)) do
        body[#body + 1] = lines[i]
        i = i + 1
      end
      tag = (tag or ""):lower()
      if SHELL_TAGS[tag] then
        for k, b in ipairs(body) do add({ cmd = shell_command(b), line = start + k, kind = "block" }) end
      elseif tag == "lua" and body[1] then
        local cmd = body[1]:match("^%-%-%s*run with:%s*(.-)%s*$") or body[1]:match("^%-%-%s*(.-)%s*$")
        if cmd and is_command(cmd) then
          local file
          for w in cmd:gmatch("%S+") do if w:match("%.lua$") then file = w end end
          if file then
            add({ cmd = cmd, line = start + 1, kind = "script", file = file,
                  text = table.concat(body, "\n") .. "\n" })
          end
        end
      end
      prev_blank = false
    elseif l:match("^    %S") and prev_blank then
      -- an indented code block: this line and the indented ones after it
      while i <= #lines and (lines[i]:match("^    ") or lines[i]:match("^%s*$")) do
        add({ cmd = shell_command(lines[i]), line = i, kind = "block" })
        i = i + 1
      end
      i = i - 1
      prev_blank = false
    elseif l:match("^%s*|") then
      -- a table row's inline spans (a span does not cross lines here)
      for span in l:gmatch("`([^`]+)`") do
        local s = trim(span:gsub("\\|", "|"))
        if is_command(s) then add({ cmd = s, line = i, kind = "span" }) end
      end
      prev_blank = false
    else
      prev_blank = l:match("^%s*$") ~= nil
    end
    i = i + 1
  end
  return out
end

function M.extract_file(path)
  local f = assert(io.open(path, "r"))
  local text = f:read("*a")
  f:close()
  return M.extract(text)
end

-- A command written as a template for the reader to fill in ("-n N",
-- "[--json | --svg FILE]", "<script>"), or nil: why it cannot run as written.
function M.placeholder(cmd)
  if cmd:find("[", 1, true) or cmd:find("<", 1, true) then return "a template ([...] / <...>)" end
  for w in cmd:gmatch("%S+") do
    if w:match("^%u+$") then return ("a template (placeholder %s)"):format(w) end
  end
  return nil
end

return M
