-- 2 ranks: the TP group broadcasts objects through the shm message queue
-- (WEFT_USE_MQ_BROADCASTER=1), from index 0 through the ring, from index 1
-- through the store.
local weft = require("weft")
weft.init()
weft.initialize_model_parallel{tp = 2}
local tp = weft.tp()
assert(tp.mq_broadcaster, "tp group has no mq broadcaster")
for i = 1, 50 do
  local obj = tp:broadcast_object(tp.rank_in_group == 0 and {step = i, data = ("x"):rep(i * 100)} or nil, 0)
  assert(obj.step == i and #obj.data == i * 100)
end
local o1 = tp:broadcast_object(tp.rank_in_group == 1 and {from = 1} or nil, 1)
assert(o1.from == 1)
print("mq broadcast_object ok on rank", tp.rank)
weft.destroy_model_parallel(); weft.shutdown()
