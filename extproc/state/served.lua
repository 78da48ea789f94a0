-- Work served per lane and tenant over the fleet (predicted seconds, cumulative): the fair queues'
-- shared part. Each replica adds what it served since its last call and reads the totals of the
-- tenants it has queued; the others' part is the change it did not add itself.
-- KEYS[1] a hash, field '<lane>|<tenant>' -> seconds. ARGV[1] the hash's lifetime after the last
-- call (ms), ARGV[2] the most fields kept (beyond it the totals start over: a bound on what
-- untrusted tenant names can cost), ARGV[3] how many field, seconds pairs follow; then the fields
-- to read. Garbage (not a hash, a field that is not a number) is replaced.
-- Returns the totals of the fields to read (false where there is none).
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then redis.call('DEL', KEYS[1]) end
local pairs_end = 3 + 2 * tonumber(ARGV[3])
for i = 4, pairs_end, 2 do
  if not pcall(redis.call, 'HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
if redis.call('HLEN', KEYS[1]) > tonumber(ARGV[2]) then redis.call('DEL', KEYS[1]) end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
-- One HGET per field, not HMGET over unpack(ARGV): unpack fails above ~8000 values (Lua's stack).
local out = {}
for i = pairs_end + 1, #ARGV do
  out[#out + 1] = redis.call('HGET', KEYS[1], ARGV[i])
end
return out
