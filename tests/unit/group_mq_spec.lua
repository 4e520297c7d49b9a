-- broadcast_object on the TP group uses the message-queue broadcaster when
-- WEFT_USE_MQ_BROADCASTER=1 (the seed's use_message_queue_broadcaster).
describe("GroupCoordinator with the mq broadcaster", function()
  it("broadcasts objects through the ring and falls back for other sources", function()
    local p = io.popen("WEFT_USE_MQ_BROADCASTER=1 timeout 60 scripts/weft-run -n 2 "
                       .. "tests/helpers/group_mq.lua 2>&1; echo rc=$?")
    local out = p:read("*a"); p:close()
    assert.is_truthy(out:match("rc=0"), out)
    assert.is_truthy(out:match("%[rank0%] mq broadcast_object ok"), out)
    assert.is_truthy(out:match("%[rank1%] mq broadcast_object ok"), out)
  end)
end)
