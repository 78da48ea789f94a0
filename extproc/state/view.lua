-- Read the cluster: live replicas, unexpired leases per lane, live replicas' summaries.
-- KEYS[1] liveness zset, KEYS[2] queue summaries hash, KEYS[3] completions hash, KEYS[4..] lease
-- zsets.
-- Returns {replicas, lease counts in KEYS order, summaries, tenant summaries (false: none),
-- per lease key the holders as a flat list replica, count, replica, count ..., completions as a
-- flat list lane, count, ...}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local above = '(' .. now
local replicas = redis.call('ZRANGEBYSCORE', KEYS[1], above, '+inf')
local counts, holders = {}, {}
for i = 4, #KEYS do
  local members = redis.call('ZRANGEBYSCORE', KEYS[i], above, '+inf')
  counts[#counts + 1] = #members
  -- A member is "<replica>:<lease>": who holds how many, for the outage fallback's allotment.
  local by, order = {}, {}
  for _, member in ipairs(members) do
    local replica = string.match(member, '^([^:]*)')
    if by[replica] == nil then by[replica] = 0; order[#order + 1] = replica end
    by[replica] = by[replica] + 1
  end
  local flat = {}
  for _, replica in ipairs(order) do flat[#flat + 1] = replica; flat[#flat + 1] = by[replica] end
  holders[#holders + 1] = flat
end
local summaries, tenants = {}, {}
if #replicas > 0 then
  local fields = {}
  for i, r in ipairs(replicas) do fields[i] = r .. '|t' end
  summaries = redis.call('HMGET', KEYS[2], unpack(replicas))
  tenants = redis.call('HMGET', KEYS[2], unpack(fields))
end
return {replicas, counts, summaries, tenants, holders, redis.call('HGETALL', KEYS[3])}
