-- extproc.usage: the tokens a response used, read from the response as it streams by, for the
-- tenant token budgets. Runs in Envoy (no byte of the response goes to extproc): a failure here
-- is logged and the response passes on unchanged.
--
-- Only for requests extproc admitted while token budgets are on (it then sets dynamic metadata
-- extproc.admitted_ms); every other response is not looked at.
--   * usage: the last "total_tokens": N in the body (a JSON answer's usage, a stream's final
--     usage event, or each event's with continuous_usage_stats), set as dynamic metadata
--     extproc.usage.total_tokens; the rate limit filter sends it to extproc when the stream ends.
--   * strip: when extproc asked the model server for a stream's usage on the client's behalf
--     (extproc.strip_usage = "1"), that usage event ("choices": [] with a "usage" object) is
--     removed before the client sees it. An event split across two reads passes unchanged.
-- The same file is inlined in envoy.yaml, compose.yaml and the Istio EnvoyFilters (a test keeps
-- the copies equal).

local TOTAL = '[^\\]"total_tokens"%s*:%s*(%d+)'

local function last_total(data)
  local found = nil
  for n in string.gmatch(data, TOTAL) do
    found = n
  end
  return found
end

local function is_usage_event(event)
  return string.sub(event, 1, 5) == "data:"
    and string.find(event, '"choices"%s*:%s*%[%s*%]') ~= nil
    and string.find(event, '"usage"%s*:%s*{') ~= nil
end

local function strip_usage(data)
  local kept, pos, changed = {}, 1, false
  while true do
    local s, e = string.find(data, "\n\n", pos, true)
    if s == nil then
      kept[#kept + 1] = string.sub(data, pos)
      break
    end
    local event = string.sub(data, pos, e)
    if is_usage_event(event) then
      changed = true
    else
      kept[#kept + 1] = event
    end
    pos = e + 1
  end
  if changed then
    return table.concat(kept)
  end
  return nil
end

function envoy_on_request(handle)
end

function envoy_on_response(handle)
  local meta = handle:streamInfo():dynamicMetadata():get("extproc")
  if meta == nil or meta["admitted_ms"] == nil then
    return
  end
  local strip = meta["strip_usage"] == "1"
  local tail = ""
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      local data = chunk:getBytes(0, n)
      if string.find(data, "total_tokens", 1, true) ~= nil or string.find(tail, "total_", 1, true) ~= nil then
        local total = last_total(tail .. data)
        if total ~= nil then
          handle:streamInfo():dynamicMetadata():set("extproc.usage", "total_tokens", total)
        end
        if strip then
          local out = strip_usage(data)
          if out ~= nil then
            chunk:setBytes(out)
          end
        end
      end
      tail = " " .. string.sub(data, -40)
    end
  end
end
