-- One fleet limit for every replica (capacity.max_inflight: auto): the leader's proposal wins.
-- KEYS[1] leader key, KEYS[2] limit key. ARGV[1] replica, ARGV[2] proposal, ARGV[3] leader TTL ms.
-- A replica leads while it renews within the TTL; when the leader dies another takes over and
-- continues from the stored limit (followers adopt it, so their proposals start there).
-- Returns {1 if this replica leads else 0, the fleet limit}.
local leader = redis.call('GET', KEYS[1])
if (not leader) or leader == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  redis.call('SET', KEYS[2], ARGV[2], 'PX', 86400000)
  return {1, tonumber(ARGV[2])}
end
local limit = redis.call('GET', KEYS[2])
if not limit then return {0, tonumber(ARGV[2])} end
return {0, tonumber(limit)}
