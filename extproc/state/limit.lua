-- One fleet limit for every replica (capacity.max_inflight: auto): the leader's proposal wins.
-- KEYS[1] leader key, KEYS[2] limit key. ARGV[1] replica, ARGV[2] proposal, ARGV[3] leader TTL ms,
-- ARGV[4] "1" if the proposal is the replica's starting value (not a limit it found), ARGV[5] the
-- stored limit's TTL ms (renewed by every leader's write).
-- A replica leads while it renews within the TTL; when the leader dies another takes over and
-- continues from the stored limit (followers adopt it, so their proposals start there; a starting
-- replica that finds no live leader adopts it too, while it lives: a whole-fleet restart resumes
-- where the fleet was).
-- Returns {1 if this replica leads else 0, the fleet limit}.
local leader = redis.call('GET', KEYS[1])
local limit = redis.call('GET', KEYS[2])
if (not leader) or leader == ARGV[1] then
  local value = ARGV[2]
  if (not leader) and ARGV[4] == '1' and limit then value = limit end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  redis.call('SET', KEYS[2], value, 'PX', ARGV[5])
  return {1, tonumber(value)}
end
if not limit then return {0, tonumber(ARGV[2])} end
return {0, tonumber(limit)}
