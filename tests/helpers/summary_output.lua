-- busted output handler for scripts/run-tests (set in .busted): busted's own
-- terminal output (progress marks, the status line, every failure and error
-- in full), except that skipped tests are summed up as one line per spec
-- file with its reasons instead of three lines each (on a machine without a
-- GPU that was ~870 lines of "Pending -> ... no CUDA device"), and the failed
-- tests named once more, a line each, at the very end (where a log cut to
-- its last lines still shows them). The counts are busted's: a skipped test
-- still counts as skipped in the status line.
-- WEFT_TEST_PENDING=all lists every skipped test as busted does.
local function first_line(m)
  if type(m) ~= "string" then m = m ~= nil and tostring(m) or "" end
  m = m:match("^%s*([^\n]*)") or ""
  m = m:gsub("^[%w_/%.%-]+%.lua:%d+: ", "")   -- where pending() was called: the file line says where
  if #m > 120 then m = m:sub(1, 117) .. "..." end
  return m
end

return function(options)
  local busted = require("busted")
  local ok_term, term = pcall(require, "term")
  local tty = ok_term and io.type(io.stdout) == "file" and term.isatty(io.stdout)
  local inner = require("busted.outputHandlers." .. (tty and "utfTerminal" or "plainTerminal"))(options)
  if os.getenv("WEFT_TEST_PENDING") == "all" then return inner end

  -- the spec file each skipped test ran in (its `it` may come from a helper)
  local kept, current = {}, "?"
  busted.subscribe({ "file", "start" }, function(file)
    current = file and file.name or "?"
    return nil, true
  end)
  busted.subscribe({ "test", "end" }, function(element, _, status)
    if status == "pending" then   -- busted's base handler has just recorded it, with its message
      local p = inner.pendings[#inner.pendings] or {}
      kept[#kept + 1] = { file = current, message = p.message, name = p.name or element.name }
    end
    return nil, true
  end, { predicate = inner.cancelOnPending })
  -- before the stock suite end, which would print each pending test
  busted.subscribe({ "suite", "end" }, function()
    inner.pendings = {}
    return nil, true
  end, { priority = 1 })

  -- after it: one line per spec file, its skipped count and why
  busted.subscribe({ "suite", "end" }, function()
    local files, order = {}, {}
    for _, p in ipairs(kept) do
      local file = p.file
      local f = files[file]
      if not f then
        f = { n = 0, reasons = {}, order = {} }
        files[file] = f
        order[#order + 1] = file
      end
      f.n = f.n + 1
      local why = first_line(p.message)
      if why == "" then why = "pending: " .. first_line(p.name) end
      if not f.reasons[why] then f.reasons[why] = 0; f.order[#f.order + 1] = why end
      f.reasons[why] = f.reasons[why] + 1
    end
    if #order > 0 then io.write("\n") end
    for _, file in ipairs(order) do
      local f = files[file]
      local parts = {}
      for i, why in ipairs(f.order) do
        if i > 4 then parts[#parts + 1] = ("%d more reasons"):format(#f.order - 4); break end
        parts[#parts + 1] = #f.order > 1 and ("%s (%d)"):format(why, f.reasons[why]) or why
      end
      io.write(("skipped %d in %s: %s\n"):format(f.n, file, table.concat(parts, "; ")))
    end
    if #order > 0 then
      io.write("(WEFT_TEST_PENDING=all lists each skipped test)\n")
    end
    -- the failures again, a line each, last: a log cut to its tail (CI
    -- keeps the last lines) still says which tests failed
    local bad = {}
    for _, kind in ipairs { "failures", "errors" } do
      for _, f in ipairs(inner[kind] or {}) do
        local where = f.trace and f.trace.short_src and (f.trace.short_src .. ":" .. (f.trace.currentline or "?")) or "?"
        bad[#bad + 1] = ("%s %s: %s: %s"):format(kind == "failures" and "FAILED" or "ERROR", where,
                                                 first_line(f.name), first_line(f.message))
      end
    end
    if #bad > 0 then io.write("\n", table.concat(bad, "\n"), "\n") end
    io.flush()
    return nil, true
  end)

  return inner
end
