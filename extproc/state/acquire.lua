-- Grant one slot if every limit, counted over all replicas, still allows it.
--
-- KEYS[1] liveness (zset replica -> expiry ms), KEYS[2] queue summaries (hash), KEYS[3] lane names
-- (set), KEYS[4..] one lease zset (member -> expiry ms) per lane of the limits, in their order.
-- ARGV: member, lane index (1-based), rank ('' for none), then the settings as JSON (the same for
-- every call with the same limits, so the caller encodes them once): {ttl (ms), capacity,
-- tolerance, replica, channel, lanes: [[name, max_inflight, borrow (1/0), max_borrow (-1: none)]...]}.
-- Returns the verdict's value. Mirrors Limits.check and outranked() in extproc/state/__init__.py.

local alive_key, queues_key, lanes_key = KEYS[1], KEYS[2], KEYS[3]
local member, idx, rank = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local cfg = cjson.decode(ARGV[4])
local ttl, capacity, tolerance, replica, channel = cfg.ttl, cfg.capacity, cfg.tolerance, cfg.replica, cfg.channel
local n = #KEYS - 3
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function lane(i, field) return cfg.lanes[i][field] end

-- A dead replica's queue stops counting (and may have been blocking someone).
local dead = redis.call('ZRANGEBYSCORE', alive_key, '-inf', now)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', alive_key, '-inf', now)
  for _, r in ipairs(dead) do redis.call('HDEL', queues_key, r, r .. '|t') end
  redis.call('PUBLISH', channel, '*')
end

local inflight, total = {}, 0
for i = 1, n do
  local key = KEYS[3 + i]
  if redis.call('ZREMRANGEBYSCORE', key, '-inf', now) > 0 then
    redis.call('PUBLISH', channel, lane(i, 1))
  end
  inflight[i] = redis.call('ZCARD', key)
  total = total + inflight[i]
end

local key = KEYS[3 + idx]
if redis.call('ZSCORE', key, member) then
  redis.call('ZADD', key, now + ttl, member)
  return 'granted'
end
if total >= capacity then return 'capacity' end

local summaries = nil
local function load()
  if summaries then return summaries end
  summaries = {}
  local replicas = redis.call('ZRANGE', alive_key, 0, -1)
  if #replicas > 0 then
    local raw = redis.call('HMGET', queues_key, unpack(replicas))
    for j, s in ipairs(replicas) do
      if raw[j] then
        local d = cjson.decode(raw[j])
        d.replica = s
        summaries[#summaries + 1] = d
      end
    end
  end
  return summaries
end

local mine, limit = inflight[idx], lane(idx, 2)
local free
if mine < limit then
  free = math.min(limit - mine, capacity - total)
else
  if lane(idx, 3) ~= 1 then return 'lane_full' end
  local max_borrow = lane(idx, 4)
  if max_borrow >= 0 and mine >= limit + max_borrow then return 'borrow_limit' end
  local owed = 0
  for i = 1, n do
    if i ~= idx then
      local name, waiting = lane(i, 1), 0
      for _, s in ipairs(load()) do waiting = waiting + (s.q[name] or 0) end
      if waiting > 0 then
        owed = owed + math.min(waiting, math.max(0, lane(i, 2) - inflight[i]))
      end
    end
  end
  free = capacity - total - owed
  if free <= 0 then return 'owed' end
  if max_borrow >= 0 then free = math.min(free, limit + max_borrow - mine) end
end

if rank ~= '' then
  local bar, name, better = tonumber(rank) - tolerance, lane(idx, 1), 0
  for _, s in ipairs(load()) do
    local head = s.h[name]
    if s.replica ~= replica and head and head < bar then better = better + 1 end
  end
  if better >= free then return 'outranked' end
end

redis.call('ZADD', key, now + ttl, member)
redis.call('SADD', lanes_key, lane(idx, 1))
return 'granted'
