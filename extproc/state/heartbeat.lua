-- Renew one replica: its liveness mark, its queue summary, every lease it holds; drop the
-- leases it gave up while Redis was unreachable; purge what expired, waking everyone for it.
--
-- KEYS[1] liveness zset, KEYS[2] queue summaries hash, KEYS[3] set of lane names,
-- KEYS[4..] one lease zset per lane of ARGV[7].lanes, in that order.
-- ARGV: replica, ttl ms, queue ttl ms, channel, summary json ('' deletes: nothing queued),
-- tenants json ('' deletes), plan json {lanes: [...], hold: [[member...]...], drop: [[...]...]},
-- leave ('1': withdraw the replica after dropping, instead of renewing it).
-- Returns {live replicas, re-added leases as "lane index:member"}: a lease missing from Redis
-- (expired while the replica stalled, or Redis restarted empty) is put back, because its
-- request still runs.

local alive_key, queues_key, lanes_key = KEYS[1], KEYS[2], KEYS[3]
local replica, ttl, queue_ttl, channel = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local summary, tenants, plan, leave = ARGV[5], ARGV[6], cjson.decode(ARGV[7]), ARGV[8] == '1'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local dead = redis.call('ZRANGEBYSCORE', alive_key, '-inf', now)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', alive_key, '-inf', now)
  for _, r in ipairs(dead) do redis.call('HDEL', queues_key, r, r .. '|t') end
  redis.call('PUBLISH', channel, '*')
end

local readded = {}
for i, name in ipairs(plan.lanes) do
  local key = KEYS[3 + i]
  local freed = redis.call('ZREMRANGEBYSCORE', key, '-inf', now) > 0
  redis.call('SADD', lanes_key, name)
  for _, m in ipairs(plan.drop[i]) do
    if redis.call('ZREM', key, m) == 1 then freed = true end
  end
  for _, m in ipairs(plan.hold[i]) do
    if redis.call('ZADD', key, now + ttl, m) == 1 then readded[#readded + 1] = i .. ':' .. m end
  end
  if freed then redis.call('PUBLISH', channel, name) end
end

if leave then
  redis.call('ZREM', alive_key, replica)
  if redis.call('HDEL', queues_key, replica, replica .. '|t') > 0 then redis.call('PUBLISH', channel, '*') end
else
  redis.call('ZADD', alive_key, now + queue_ttl, replica)
  if summary ~= '' then
    redis.call('HSET', queues_key, replica, summary)
  else
    redis.call('HDEL', queues_key, replica)
  end
  if tenants ~= '' then
    redis.call('HSET', queues_key, replica .. '|t', tenants)
  else
    redis.call('HDEL', queues_key, replica .. '|t')
  end
end
return {redis.call('ZRANGE', alive_key, 0, -1), readded}
