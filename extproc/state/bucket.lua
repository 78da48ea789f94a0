-- Tenant budgets shared by the fleet: token buckets, the arithmetic of extproc.core.budget.Budget.
-- KEYS: one hash per bucket (fields: level, at). ARGV[1]: now in seconds ('' = Redis TIME, so
-- replica clocks do not matter); then five per bucket: op ('check' | 'take' | 'charge'),
-- per_second, burst, amount, the most a bucket may live idle (ms).
-- Buckets are done in order; a 'take' after a refused one only checks (a request refused by
-- any budget costs nothing). A bucket that is missing is full (it expired once full, or was
-- never used); a key is kept only while it is below full (its TTL: the refill time), so idle
-- tenants cost no memory. A value that is not a number (garbage in the key) counts as missing.
-- Returns, per bucket, {1 if allowed else 0, level after the call as a string}.
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local out = {}
local refused = false
for i, key in ipairs(KEYS) do
  local base = 1 + (i - 1) * 5
  local op = ARGV[base + 1]
  local rate = tonumber(ARGV[base + 2])
  local burst = tonumber(ARGV[base + 3])
  local amount = tonumber(ARGV[base + 4])
  local idle_ms = tonumber(ARGV[base + 5])
  local ok, fields = pcall(redis.call, 'HMGET', key, 'level', 'at')
  local level, at = nil, nil
  if ok then level, at = tonumber(fields[1]), tonumber(fields[2]) end
  if level ~= level or at ~= at then level, at = nil, nil end  -- NaN
  local stored = level ~= nil and at ~= nil
  local allowed
  if op == 'check' and not stored then
    level = burst
    allowed = amount <= burst
  else
    if stored then
      local elapsed = now - at
      if elapsed < 0 then elapsed = 0 end
      level = math.min(burst, level + elapsed * rate)
      if now > at then at = now end
    else
      level, at = burst, now
    end
    if op == 'take' and refused then op = 'check' end
    if op == 'take' then
      allowed = level >= amount
      if allowed then level = level - amount end
    elseif op == 'charge' then
      if amount > 0 then level = level - amount end
      allowed = level >= 1.0
    else
      allowed = level >= amount
    end
    if not ok then redis.call('DEL', key) end  -- garbage of another type: start afresh
    if level >= burst then
      -- Full: exactly what a missing key means. (Kept until the next call would refill nothing.)
      redis.call('DEL', key)
    else
      local ttl = math.ceil((burst - level) / rate * 1000) + 1000
      if ttl > idle_ms then ttl = idle_ms end
      redis.call('HSET', key, 'level', string.format('%.17g', level), 'at', string.format('%.17g', at))
      redis.call('PEXPIRE', key, ttl)
    end
  end
  if not allowed then refused = true end
  out[i] = {allowed and 1 or 0, string.format('%.17g', level)}
end
return out
