-- Read the cluster: live replicas, unexpired leases per lane, live replicas' summaries.
-- KEYS[1] liveness zset, KEYS[2] queue summaries hash, KEYS[3..] lease zsets.
-- Returns {replicas, lease counts in KEYS order, summaries, tenant summaries} (false: none).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local above = '(' .. now
local replicas = redis.call('ZRANGEBYSCORE', KEYS[1], above, '+inf')
local counts = {}
for i = 3, #KEYS do counts[#counts + 1] = redis.call('ZCOUNT', KEYS[i], above, '+inf') end
local summaries, tenants = {}, {}
if #replicas > 0 then
  local fields = {}
  for i, r in ipairs(replicas) do fields[i] = r .. '|t' end
  summaries = redis.call('HMGET', KEYS[2], unpack(replicas))
  tenants = redis.call('HMGET', KEYS[2], unpack(fields))
end
return {replicas, counts, summaries, tenants}
