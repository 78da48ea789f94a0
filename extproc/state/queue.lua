-- Replace one replica's queue summary (and renew its liveness mark); wake the lanes where the
-- change may let another replica in.
-- KEYS[1] liveness zset, KEYS[2] queue summaries hash.
-- ARGV: replica, queue ttl ms, summary json ('': nothing queued, so no summary: releases wake
-- nobody while no replica has one), tenants json ('' deletes), channel, then lanes to wake.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local replica = ARGV[1]
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), replica)
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], replica, ARGV[3])
else
  redis.call('HDEL', KEYS[2], replica)
end
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[2], replica .. '|t', ARGV[4])
else
  redis.call('HDEL', KEYS[2], replica .. '|t')
end
for i = 6, #ARGV do redis.call('PUBLISH', ARGV[5], ARGV[i]) end
return 1
