-- Tenant budgets shared by the fleet: token buckets, the arithmetic of extproc.core.budget.Budget.
-- KEYS: one hash per bucket (fields: level, at). ARGV[1]: now in seconds ('' = Redis TIME, so
-- replica clocks do not matter); then five per bucket: op ('check' | 'take' | 'charge'),
-- per_second, burst, amount, the most a bucket may live idle (ms).
-- Buckets are done in order; a 'take' after a refused one only checks (a request refused by
-- any budget costs nothing). A bucket that is missing is full (it expired once full, or was
-- never used); a key is kept only while it is below full (its TTL: the refill time), so idle
-- tenants cost no memory. A value that is not a finite number (garbage in the key: text, NaN, ±inf)
-- counts as missing: a full bucket (an infinite debt would lock a tenant out for good, each call
-- renewing the key). A stored time ahead of now (a clock step, a failover to a primary whose clock is
-- behind) counts from now: otherwise the refill would stop until the clock caught up. (The pure Budget
-- keeps the latest time instead: its clock is monotonic; this one is a server's wall clock, which
-- steps. Counting from now forgives at most the step, and never more than one burst.)
-- Returns, per bucket, {1 if allowed else 0, level after the call as a string}.
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function finite(x)
  return x ~= nil and x == x and x > -math.huge and x < math.huge
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
  if not (finite(level) and finite(at)) then level, at = nil, nil end  -- garbage: a full bucket
  local stored = level ~= nil and at ~= nil
  local allowed
  if op == 'check' and not stored then
    level = burst
    allowed = amount <= burst
  else
    if stored then
      if at > now then at = now end  -- ahead of now: count from now (see above)
      level = math.min(burst, level + (now - at) * rate)
      at = now
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
