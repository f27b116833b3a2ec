"""The rate controller's two scripts (worker.edges.rate_control): each reads a controller's
state, decides and writes it back in one atomic step, so every worker of the fleet sees one
controller. Times are milliseconds: Redis's own clock (TIME), so that workers on machines with
skewed clocks agree, or the caller's when it passes one (the tests' fake clock).

The state's fields are named in schemas/rate_state.py (the status and metrics read them).
"""

from __future__ import annotations

from schemas.rate_state import FIELDS, RATE_TAU_MS

W0 = 16  # the first window: a slow start from here doubles it while it is used up
W_MAX = 4096
TAU_MS = 250  # how early a paced call may go: a burst of a quarter second's pace at most
EARLY_MS = 20  # a waiting round coming back this early still counts as on time
STALE_MS = 30_000  # a waiting room ticket this overdue is dropped (its round went elsewhere)
CUT = 0.8  # a window's cut per 429 episode
PACE_CUT = 0.8  # a pace's cut per 429 episode (with none yet: of the rate calls went at)
GROW = 0.05  # growth per saturated epoch after slow start
PROBE = 0.01  # near the pace 429s came at, a pace grows by this share of it an epoch
MIN_PACE = 0.05  # a learned pace never falls below (3 calls a minute)
STORM_MS = 10_000  # 429 episodes this close to the last are one storm
CALM_MS = 60_000  # no 429 for this long (and no pace): far from the limit, slots go in blocks

_FIELDS = ", ".join(f"'{name}'" for name in FIELDS)
_PRELUDE = f"""
local W0, W_MAX, TAU, EARLY, STALE = {W0}, {W_MAX}, {TAU_MS}, {EARLY_MS}, {STALE_MS}
local RATE_TAU, CUT, PACE_CUT, GROW, PROBE = {RATE_TAU_MS}, {CUT}, {PACE_CUT}, {GROW}, {PROBE}
local MIN_PACE, STORM_MS, CALM = {MIN_PACE}, {STORM_MS}, {CALM_MS}
local FIELDS = {{{_FIELDS}}}

local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function load(key)
  local values = redis.call('HMGET', key, unpack(FIELDS))
  local s = {{}}
  for i, f in ipairs(FIELDS) do
    if f == 'why' then s[f] = values[i] or '' else s[f] = tonumber(values[i]) or 0 end
  end
  if s.w <= 0 then  -- a new controller: its first epoch starts now
    s.w, s.ss, s.grow, s.new = W0, 1, now, 1
  end
  return s
end

-- the state written back; its keys' TTLs (and the index) renewed when it is new, when it
-- changed, and every 64th call: not on each call, which costs Redis a command apiece
local function save(s, ttl)
  local args = {{}}
  for _, f in ipairs(FIELDS) do
    args[#args + 1] = f
    args[#args + 1] = tostring(s[f])
  end
  redis.call('HSET', KEYS[1], unpack(args))
  if s.new or s.changed or s.n % 64 == 0 then
    redis.call('EXPIRE', KEYS[1], ttl)
    redis.call('PEXPIRE', KEYS[2], ttl * 1000)
    if KEYS[4] then  -- the index of controllers; on a cluster its writer is the worker's own
      redis.call('HSET', KEYS[4], ARGV[2], now)
      redis.call('EXPIRE', KEYS[4], ttl)
    end
  end
end

-- an epoch: a call's time, between 0.1 and 1 s (a slow model must not slow the growth of a
-- window it has not tried yet: 429s come back at once)
local function epoch(s)
  if s.lat <= 0 then return 1000 end
  return math.min(math.max(s.lat, 100), 1000)
end

-- the pace a call is held to: the provider's, a learned one below it, a configured ceiling
local function pace(s, ceiling)
  local p = s.hrps
  if s.lp > 0 and (p == 0 or s.lp < p) then p = s.lp end
  if ceiling > 0 and (p == 0 or ceiling < p) then p = ceiling end
  return p
end

local function token_pace(s, ceiling)
  local p = s.htps
  if ceiling > 0 and (p == 0 or ceiling < p) then p = ceiling end
  return p
end

local function latency(s)
  if s.lat > 0 then return s.lat end
  return 1000  -- no call has ended yet
end

local function changed(s, why)
  s.why = why
  s.when = now
  s.changed = 1
end

local function change_of(s, ceiling)
  if s.changed then return {{s.why, tostring(s.w), tostring(pace(s, ceiling))}} end
  return {{}}
end
"""

# KEYS: state, slots, room, index
# ARGV: now_ms ('' = Redis's), id, slot, waiter, estimated tokens, lease_ms, ceiling rps,
#       ceiling tps, room_ms, ttl_s, block (the most slots a process asks for at once)
# -> {'ok', change, granted} | {'wait', ms, reason, change} | {'far', ms, reason, change}
# Far from the limit (no pace of any kind, no 429 for CALM_MS, nobody waiting, the window at
# most half used, a latency known: a cold start's first calls ask one by one) a grant is a
# block of slots, `slot` and `slot.2` ... `slot.<granted>`, which the asking process keeps for
# its next calls (rate_permits.py); granted 0: one slot, not kept.
ACQUIRE = (
    _PRELUDE
    + """
local slot, waiter = ARGV[3], ARGV[4]
local est, lease = tonumber(ARGV[5]), tonumber(ARGV[6])
local crps, ctps = tonumber(ARGV[7]), tonumber(ARGV[8])
local room_ms, ttl = tonumber(ARGV[9]), tonumber(ARGV[10])
local block = tonumber(ARGV[11]) or 0
local s = load(KEYS[1])
s.crps, s.ctps = crps, ctps  -- for the status: the pace it shows is the one calls are held to

-- a ticket is looked for only while the room may hold one (a ticket this stale is dropped)
local ticket = nil
if s.tail > now - STALE then ticket = tonumber(redis.call('ZSCORE', KEYS[3], waiter)) end
if ticket and ticket > now + EARLY then
  return {'wait', tostring(ticket - now), 'queued', {}}
end

local inflight = redis.call('ZCARD', KEYS[2])
if inflight >= math.max(math.floor(s.w), 1) then  -- full: drop the slots whose lease ran out
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  inflight = redis.call('ZCARD', KEYS[2])
end
local p, tp = pace(s, crps), token_pace(s, ctps)
local win_ok = inflight < math.max(math.floor(s.w), 1)
local pace_ok = p == 0 or s.tat <= now + TAU
local tok_ok = tp == 0 or s.ttat <= now + TAU
-- growth waits an epoch, and for 429s to have stopped for three of them
local calm = now - s.l429 >= 3 * epoch(s) and now - s.grow >= epoch(s)
if not win_ok and calm then
  -- the window was used up: it grows, doubling in slow start
  if s.ss == 1 then
    s.w = math.min(s.w * 2, W_MAX)
    changed(s, 'slow start')
  else
    s.w = math.min(s.w + math.max(1, s.w * GROW), W_MAX)
    changed(s, 'grow')
  end
  s.grow = now
  win_ok = inflight < math.floor(s.w)
elseif win_ok and not pace_ok and s.lp > 0 and calm then
  -- a pace learned from 429s grows back while it is what holds calls back: gently near the
  -- pace the 429s came at, faster once past it without one (the limit moved)
  if s.pmax > 0 and s.lp >= (1 - GROW) * s.pmax then
    s.lp = s.lp + PROBE * s.pmax
  else
    s.lp = s.lp * (1 + GROW)
  end
  if s.pmax > 0 and s.lp > s.pmax then s.pmax = 0 end
  if s.hrps > 0 and s.lp >= s.hrps then s.lp = 0 end
  s.grow = now
  changed(s, 'grow')
end

if win_ok and pace_ok and tok_ok then
  local granted = 0
  if block > 0 and p == 0 and tp == 0 and s.lp == 0 and now - s.l429 >= CALM and not ticket
      and s.tail <= now and s.lat > 0 then
    granted = math.max(math.min(block, math.floor(math.floor(s.w) / 2) - inflight), 1)
  end
  local members = {now + lease, slot}
  for i = 2, granted do
    members[#members + 1] = now + lease
    members[#members + 1] = slot .. '.' .. i
  end
  redis.call('ZADD', KEYS[2], unpack(members))
  -- none in flight: the slots were made again (Redis drops an empty set), and save() renews
  -- their TTL only now and then
  if inflight == 0 then redis.call('PEXPIRE', KEYS[2], ttl * 1000) end
  if p > 0 then s.tat = math.max(s.tat, now - TAU) + 1000 / p end
  if tp > 0 then s.ttat = math.max(s.ttat, now - TAU) + est * 1000 / tp end
  if ticket then redis.call('ZREM', KEYS[3], waiter) end
  s.racc = s.racc * math.exp(-(now - s.rt) / RATE_TAU) + 1
  s.rt = now
  s.n = s.n + 1
  save(s, ttl)
  return {'ok', change_of(s, crps), granted}
end

-- no room: a ticket in the waiting room, spaced by the pace (or the window's turnover) so
-- that waiting rounds come back one by one, not all at once
s.nden = s.nden + 1
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - STALE)
local reason = 'tokens'
if not win_ok then reason = 'window' elseif not pace_ok then reason = 'pace' end
local spacing = 0
if p > 0 then spacing = 1000 / p end
if not win_ok then spacing = math.max(spacing, latency(s) / math.max(math.floor(s.w), 1)) end
if tp > 0 then spacing = math.max(spacing, est * 1000 / tp) end
local ready = now
if not pace_ok then ready = math.max(ready, s.tat - TAU) end
if not tok_ok then ready = math.max(ready, s.ttat - TAU) end
local at = math.max(s.tail + spacing, ready)
if not win_ok then at = math.max(at, now + spacing) end
if s.ss == 1 and reason == 'window' and p == 0 then
  -- slow start, nothing known of a limit: the window doubles each epoch, so the round's turn
  -- is the epoch by which it will have doubled enough for those ahead of it and for it
  local ahead = 0  -- a round whose turn came keeps its place: the next epoch is its
  if not ticket then ahead = redis.call('ZCARD', KEYS[3]) end
  local w = math.max(math.floor(s.w), 1)
  at = now + epoch(s) * math.max(1, math.ceil(math.log((ahead + 1 + w) / w) / math.log(2)))
  redis.call('ZADD', KEYS[3], at, waiter)
  redis.call('PEXPIRE', KEYS[3], ttl * 1000)
  s.tail = math.max(s.tail, at)
  save(s, ttl)
  return {'wait', tostring(at - now), reason, change_of(s, crps)}
end
if ticket then
  -- a round whose turn came and found no room keeps its place at the front of the line
  at = math.max(ready, now + spacing)
  redis.call('ZADD', KEYS[3], at, waiter)
  save(s, ttl)
  return {'wait', tostring(at - now), reason, change_of(s, crps)}
end
if at - now <= room_ms then
  redis.call('ZADD', KEYS[3], at, waiter)
  redis.call('PEXPIRE', KEYS[3], ttl * 1000)
  s.tail = at
  save(s, ttl)
  return {'wait', tostring(at - now), reason, change_of(s, crps)}
end
-- the room is full: come back later, at a time the caller draws (no crowd comes back at once)
save(s, ttl)
return {'far', tostring(room_ms), reason, change_of(s, crps)}
"""
)

# KEYS: state, slots, room, index
# ARGV: now_ms, id, slot ('' = kept in its process's block), kind (ok | rate_limited | failed),
#       used tokens, estimated tokens, latency_ms, ceiling rps, ceiling tps, ttl_s, then what
#       the headers said ('' = not said): requests/min, requests left, ms until whole,
#       tokens/min, tokens left, ms; then the calls made from a block since its last report
# -> {change, tokens paced (0/1)}
REPORT = (
    _PRELUDE
    + """
local slot, kind = ARGV[3], ARGV[4]
local used, est, took = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local crps, ctps, ttl = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local rpm, left_req, reset_req = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local tpm, left_tok, reset_tok = tonumber(ARGV[14]), tonumber(ARGV[15]), tonumber(ARGV[16])
local kept = tonumber(ARGV[17]) or 0
local s = load(KEYS[1])

if slot ~= '' then redis.call('ZREM', KEYS[2], slot) end
if kept > 0 then  -- calls a block served: counted as granted (the status's figures)
  s.racc = s.racc * math.exp(-(now - s.rt) / RATE_TAU) + kept
  s.rt = now
  s.n = s.n + kept
end
if kind == 'ok' then
  if s.lat == 0 then s.lat = took else s.lat = s.lat * 0.8 + took * 0.2 end
end
local tp = token_pace(s, ctps)
if tp > 0 and used > 0 then s.ttat = s.ttat + (used - est) * 1000 / tp end

-- what the provider said sets the pace directly
if rpm and rpm > 0 then
  local hr = rpm / 60
  if math.abs(hr - s.hrps) > 0.01 * hr then
    s.hrps = hr
    s.lp = 0
    changed(s, 'header')
  end
  if left_req and left_req <= 0 then  -- spent: nothing goes before the next request is due
    local wait = 60000 / rpm
    if reset_req and reset_req < wait then wait = reset_req end
    s.tat = math.max(s.tat, now + wait + TAU)
  end
end
if tpm and tpm > 0 then
  local ht = tpm / 60
  if math.abs(ht - s.htps) > 0.01 * ht then
    s.htps = ht
    changed(s, 'header')
  end
  if left_tok and left_tok <= 0 then
    s.ttat = math.max(s.ttat, now + math.min(reset_tok or 1000, 1000) + TAU)
  end
end

if kind == 'rate_limited' then
  s.n429 = s.n429 + 1
  s.l429 = now
  local inflight = redis.call('ZCARD', KEYS[2]) + 1  -- this call among them
  if now - s.cut >= math.max(1.5 * s.lat, 1000) then  -- one cut per episode
    -- the pace 429s came at: where a storm of them began (its later cuts are not the limit)
    local fresh = now - s.cut >= STORM_MS
    s.cut = now
    s.ss = 0
    -- a pace is cut by PACE_CUT; with none yet, one is learned: PACE_CUT of the rate calls
    -- went at, by Little's law (in flight over latency), else as granted
    local current = pace(s, crps)
    local r = current
    if r == 0 then  -- Little's law, a one-second call while none has said how long it takes
      r = inflight * 1000 / latency(s)
    end
    if r > 0 then
      if fresh or s.pmax == 0 then s.pmax = r end
      s.lp = math.max(r * PACE_CUT, MIN_PACE)
    end
    if s.hrps == 0 then
      -- no header pace: the window is cut too, but never below what the learned pace needs
      local need = 0
      if s.lp > 0 then need = 1.5 * s.lp * latency(s) / 1000 end
      s.w = math.max(1, math.min(s.w, inflight) * CUT, math.min(s.w, need))
    end
    changed(s, '429 cut')
  end
  -- every 429 spaces the next call by two of the pace's intervals, its burst credit gone: a
  -- provider that counts refused calls against the limit is let out of debt, not kept in it
  local p = pace(s, crps)
  if p > 0 then s.tat = math.max(s.tat, now + TAU + 2000 / p) end
end
save(s, ttl)
local paced = 0
if token_pace(s, ctps) > 0 then paced = 1 end
return {change_of(s, crps), paced}
"""
)

# KEYS: the slots zsets; ARGV: lease_ms, then the slot of each -> how many were still held
RENEW = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local renewed = 0
for i, key in ipairs(KEYS) do
  renewed = renewed + redis.call('ZADD', key, 'XX', 'CH', expiry, ARGV[i + 1])
end
return renewed
"""
