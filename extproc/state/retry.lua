-- The fleet's retry budget window: admitted originals (deposits) and retries let through
-- (withdrawals) per replica and slot, so every replica sees the others' counts.
-- KEYS[1] a hash, fields 'd:<slot>:<replica>' and 'w:<slot>:<replica>' (slot = Redis time in
-- slot widths). ARGV: replica, slot width (ms), slots in the window, this replica's new
-- deposits and withdrawals (since its last call), now in ms ('' = Redis TIME).
-- Fields that left the window, or are not counts (garbage: text, fractions, negative, NaN, ±inf), are
-- removed; this replica's field of the current slot too before it is added to (HINCRBY would fail).
-- The key lives two windows past the last call. Returns {deposits, withdrawals} of the *other*
-- replicas within the window (this replica counts its own, up to date).
local me, width, slots = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = tonumber(ARGV[6])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local slot = math.floor(now / width)
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then redis.call('DEL', KEYS[1]) end
local function count(x)
  return x ~= nil and x == x and x >= 0 and x < 2^53 and x == math.floor(x)
end
local function add(field, n)
  if n <= 0 then return end
  if not count(tonumber(redis.call('HGET', KEYS[1], field))) then redis.call('HDEL', KEYS[1], field) end
  redis.call('HINCRBY', KEYS[1], field, n)
end
add('d:' .. slot .. ':' .. me, tonumber(ARGV[4]) or 0)
add('w:' .. slot .. ':' .. me, tonumber(ARGV[5]) or 0)
local flat = redis.call('HGETALL', KEYS[1])
local deposits, withdrawals = 0, 0
for i = 1, #flat, 2 do
  local field, value = flat[i], tonumber(flat[i + 1])
  local kind, index, replica = string.match(field, '^([dw]):(%-?%d+):(.+)$')
  index = tonumber(index)
  if (not kind) or (not count(value)) or (not index) or index <= slot - slots or index > slot + 1 then
    redis.call('HDEL', KEYS[1], field)
  elseif replica ~= me then
    if kind == 'd' then deposits = deposits + value else withdrawals = withdrawals + value end
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], width * slots * 2) end
return {deposits, withdrawals}
