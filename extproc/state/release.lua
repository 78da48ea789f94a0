-- End one lease. If it was still held and some replica has requests waiting, wake every replica.
-- KEYS[1] the lane's lease zset, KEYS[2] queue summaries (a replica has one only while it queues),
-- KEYS[3] completions per lane (a hash: lane -> count, what the fleet's drain rate is read from).
-- ARGV: member, wake-up channel, lane name, '1' to count it as a completion ('0': a clean-up).
-- Returns 1 if the lease was removed.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  if ARGV[4] == '1' then redis.call('HINCRBY', KEYS[3], ARGV[3], 1) end
  if redis.call('HLEN', KEYS[2]) > 0 then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
  return 1
end
return 0
