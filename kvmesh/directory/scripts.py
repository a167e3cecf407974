"""The directory's Lua scripts (the parts of `kvmesh.directory` register and run them: membership, entries,
summaries, loads). Each runs atomically on one Redis Cluster slot: the node keys' `{n}` for membership, leases and
load reports; one group's `{<h1 hex>}` for holder entries. Key layout: `kvmesh.directory`'s docstring; what each
primitive mutates: its part's. A holders value as these scripts read and write it must match
`kvmesh.directory.records`' HOLDERS_VERSION and HOLDER struct.

    CLOCK_LUA     Redis's clock for a lease deadline; a step back moves every deadline back with it
    JOIN          a node joins: new incarnation, lease, info; epoch created if missing; a new membership version
    EXPIRE        end a node incarnation's lease now
    HOLDERS_LUA   the Lua helpers that read and write a holders value (prepended to the group scripts)
    CHANGED_LUA   a group's entries changed: its summaries go, and it gets a new version (prepended to them too)
    SUMMARIZE     write a prompt's bucket summaries, if the group is still at the version they were read at
    PURGE_GROUP   drop every entry of one incarnation from one group
    HEARTBEAT     extend a lease ("ok"), or say "resync" / "fenced"
    LEAVE         remove a node if still this incarnation; a new membership version
    REGISTER      add/update an incarnation's entries in one group
    UNREGISTER    remove an incarnation's entries from one group
    REPORT_LOAD   a replica's load report, stamped with Redis's clock; old reports dropped
    NODE_TABLE    the node table (whole, or only the leases that lapse soon) and Redis's clock
"""

# The incarnation counter starts at 4 x Redis's clock in seconds since 2020 (a u32 until 2053, so it packs in 4
# bytes), and never below the joining node's own last incarnation (ARGV[5]). So a Redis that restarted empty hands a
# node a new number, and does not reissue one unless nodes joined faster than 4 per second over its whole previous
# life; even then a stale client would only ask a node for a chunk by its full hash, which that node does not hold.
# Lease deadlines are times on Redis's clock. Should that clock step back (an NTP correction, a failover to a host
# whose clock is behind), a node that died just before would keep its deadline, and be listed live, for as long as
# the step. now(lease key, clock key) reads the clock and remembers the latest reading (to within a second, one
# write a second); a reading more than CLOCK_SLACK_MS behind it moves every deadline back by the step. JOIN and
# HEARTBEAT call it before they write their own deadline.
CLOCK_LUA = """
local function now_ms(lease_key, clock_key)
  local t = redis.call('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  local seen = tonumber(redis.call('GET', clock_key) or '0')
  if now + 2000 < seen then
    local back = seen - now
    local all = redis.call('ZRANGE', lease_key, 0, -1, 'WITHSCORES')
    for i = 1, #all, 2 do
      local deadline = tonumber(all[i + 1])
      if deadline > 0 then redis.call('ZADD', lease_key, math.max(1, deadline - back), all[i]) end
    end
    redis.call('SET', clock_key, now)
  elseif now >= seen + 1000 then
    redis.call('SET', clock_key, now)
  end
  return now, t
end
"""

JOIN = (
    CLOCK_LUA
    + """
redis.call('SET', KEYS[1], ARGV[2], 'NX')
local epoch = redis.call('GET', KEYS[1])
local now, t = now_ms(KEYS[4], KEYS[7])
redis.call('SET', KEYS[2], (t[1] - 1577836800) * 4, 'NX')
if tonumber(redis.call('GET', KEYS[2])) < tonumber(ARGV[5]) then redis.call('SET', KEYS[2], ARGV[5]) end
local inc = redis.call('INCR', KEYS[2])
local prev = redis.call('HGET', KEYS[3], ARGV[1]) or '0'
redis.call('HSET', KEYS[3], ARGV[1], inc)
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[5], ARGV[1], ARGV[4])
redis.call('SET', KEYS[6], ARGV[6])
return {epoch, inc, prev}
"""
)

# Ray (or an operator) says the node is gone: end its lease now rather than when it lapses.
EXPIRE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('ZADD', KEYS[2], 0, ARGV[1])
  return 1
end
return 0
"""

# A holders value (HOLDERS_VERSION 2): one version byte, then (incarnation u32 LE, tier u8) per holder, oldest
# first. holders(v) reads one (an unknown version reads as no holders); pack(hs, first) writes hs[first..].
HOLDERS_LUA = """
local function holders(v)
  local hs = {}
  if v and string.byte(v, 1) == 2 then
    for pos = 2, #v - 4, 5 do
      local inc, tier = struct.unpack('<I4B', v, pos)
      hs[#hs + 1] = {inc, tier}
    end
  end
  return hs
end
local function pack(hs, first)
  local parts = {string.char(2)}
  for j = first, #hs do parts[#parts + 1] = struct.pack('<I4B', hs[j][1], hs[j][2]) end
  return table.concat(parts)
end
"""

# A group's summaries (KEYS[2], `kvmesh.directory`'s docstring) hold copies of its entries as they were at one
# version of the group: any script that writes or removes an entry's value calls changed(), which deletes them all
# and, in a group of at least SUMMARY_MIN_ENTRIES entries (ARGV[#ARGV] of every group script), sets a new version:
# Redis's clock in microseconds, made unlike the one before should two changes share a microsecond, then ':' and
# the group's number of entries (what a reader that must read them all chooses its command by). A summary read
# at a version is written only while the group is still at it (SUMMARIZE), so a summary never lists what the
# entries no longer say.
CHANGED_LUA = """
local function changed(gkey, skey, min)
  local old = redis.call('HGET', skey, 'v')
  redis.call('DEL', skey)
  local n = redis.call('HLEN', gkey)
  if n >= min then
    local t = redis.call('TIME')
    local stamp = t[1] .. '.' .. t[2]
    local was = old and string.match(old, '^([^:]*)')
    if was and string.sub(was, 1, #stamp) == stamp then stamp = was .. '+' end
    redis.call('HSET', skey, 'v', stamp .. ':' .. n)
  end
end
"""

# KEYS[1] summaries; ARGV: the version they were read at, then (name, value) pairs. Written only if the group is
# still at that version (nothing changed since the entries they copy were read); returns 1 if written. A group's
# summaries are capped (MAX_SUMMARIES, ARGV[2]): beyond it they wait for the group's next change to clear them.
SUMMARIZE = """
if redis.call('HGET', KEYS[1], 'v') ~= ARGV[1] then return 0 end
if redis.call('HLEN', KEYS[1]) > tonumber(ARGV[2]) then return 0 end
for i = 3, #ARGV - 1, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS[1] group, KEYS[2] its summaries; ARGV[1] inc, ARGV[2] SUMMARY_MIN_ENTRIES: drop every entry of that
# incarnation from the group.
PURGE_GROUP = (
    HOLDERS_LUA
    + CHANGED_LUA
    + """
local inc = tonumber(ARGV[1])
local n = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local hs = holders(all[i + 1])
  local keep = {}
  for j = 1, #hs do
    if hs[j][1] ~= inc then keep[#keep + 1] = hs[j] end
  end
  if #keep < #hs then
    n = n + 1
    if #keep == 0 then redis.call('HDEL', KEYS[1], all[i]) else redis.call('HSET', KEYS[1], all[i], pack(keep, 1)) end
  end
end
if n > 0 then changed(KEYS[1], KEYS[2], tonumber(ARGV[2])) end
return n
"""
)

HEARTBEAT = (
    CLOCK_LUA
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[3] then return 'resync' end
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if not cur then return 'resync' end
if cur ~= ARGV[2] then
  if tonumber(cur) > tonumber(ARGV[2]) then
    -- a newer incarnation whose record is this very process's: its own JOIN ran, its reply was lost (a timeout)
    if (ARGV[5] or '') ~= '' and redis.call('HGET', KEYS[5], ARGV[1]) == ARGV[5] then return 'resync' end
    return 'fenced'  -- another process of this node joined since
  end
  return 'resync'  -- an older one: the directory went back in time (a snapshot restored), not a newer process
end
redis.call('ZADD', KEYS[3], now_ms(KEYS[3], KEYS[4]) + tonumber(ARGV[4]), ARGV[1])
return 'ok'
"""
)

LEAVE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('SET', KEYS[4], ARGV[3])
  redis.call('HDEL', KEYS[5], ARGV[1])
  return 1
end
return 0
"""

# KEYS[1] group, KEYS[2] its summaries; ARGV: inc, tier, max holders, hashes..., SUMMARY_MIN_ENTRIES. An entry
# already listing max holders others takes no more: the hashes refused are returned (their 1-based positions), and
# their writer tries them again later (when a holder has left). Dropping the oldest instead would drop a live holder
# that never learns it is no longer listed. An entry written again as it was (a resync) is no change.
REGISTER = (
    HOLDERS_LUA
    + CHANGED_LUA
    + """
local inc = tonumber(ARGV[1])
local tier = tonumber(ARGV[2])
local maxh = tonumber(ARGV[3])
local refused = {}
local dirty = false
for i = 4, #ARGV - 1 do
  local old = redis.call('HGET', KEYS[1], ARGV[i])
  local hs = {}
  for _, h in ipairs(holders(old)) do
    if h[1] ~= inc then hs[#hs + 1] = h end
  end
  if #hs >= maxh then
    refused[#refused + 1] = i - 3
  else
    hs[#hs + 1] = {inc, tier}
    local new = pack(hs, 1)
    if new ~= old then
      redis.call('HSET', KEYS[1], ARGV[i], new)
      dirty = true
    end
  end
end
if dirty then changed(KEYS[1], KEYS[2], tonumber(ARGV[#ARGV])) end
return refused
"""
)

# KEYS[1] group, KEYS[2] its summaries; ARGV: inc, hashes..., SUMMARY_MIN_ENTRIES
UNREGISTER = (
    HOLDERS_LUA
    + CHANGED_LUA
    + """
local inc = tonumber(ARGV[1])
local n = 0
local dirty = false
for i = 2, #ARGV - 1 do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    local keep, gone = {}, 0
    for _, h in ipairs(holders(v)) do
      if h[1] ~= inc then keep[#keep + 1] = h else gone = gone + 1 end
    end
    n = n + gone
    if #keep == 0 then
      redis.call('HDEL', KEYS[1], ARGV[i])
      dirty = true
    elseif gone > 0 then
      redis.call('HSET', KEYS[1], ARGV[i], pack(keep, 1))
      dirty = true
    end
  end
end
if dirty then changed(KEYS[1], KEYS[2], tonumber(ARGV[#ARGV])) end
return n
"""
)


# KEYS[1] load, KEYS[2] load_at; ARGV: replica id, packed load, keep_ms. Stamps the report with Redis's clock (what
# readers judge its age by, as they judge leases) and drops reports older than keep_ms: replicas that went away.
REPORT_LOAD = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], now)
local at = redis.call('HGETALL', KEYS[2])
for i = 1, #at, 2 do
  if now - tonumber(at[i + 1]) > tonumber(ARGV[3]) then
    redis.call('HDEL', KEYS[1], at[i])
    redis.call('HDEL', KEYS[2], at[i])
  end
end
return now
"""


# The node table and Redis's clock in one round trip, on the node keys' one slot (a pipeline's TIME would have no
# slot in Redis Cluster). A missing epoch reads as '' (a nil would end the Lua array). ARGV: the membership version
# and epoch the reader already has the rows of, and its horizon (ms). Rows (`inc`, `info`) and every lease are read
# only when the version or the epoch moved; otherwise only the leases that lapse before now + horizon, i.e. nodes
# dead or about to be (none, in a healthy cluster): a reader then holds every other lease live until that horizon.
# The last element says which it is (1: whole table).
NODE_TABLE = """
local t = redis.call('TIME')
local epoch = redis.call('GET', KEYS[1]) or ''
local ver = redis.call('GET', KEYS[5]) or '0'
if ver ~= ARGV[1] or epoch ~= ARGV[2] then
  return {t[1], t[2], epoch, ver, redis.call('HGETALL', KEYS[2]), redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES'),
          redis.call('HGETALL', KEYS[4]), 1}
end
local now = t[1] * 1000 + math.floor(t[2] / 1000)
return {t[1], t[2], epoch, ver, {}, redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. (now + tonumber(ARGV[3])),
        'WITHSCORES'), {}, 0}
"""


def no_writes(script: str) -> str:
    """`script` flagged read-only (Redis >= 7 reads the shebang; older servers refuse it): it runs during a write
    pause (CLIENT PAUSE WRITE, a FAILOVER) and on a read-only replica."""
    return "#!lua flags=no-writes\n" + script.lstrip("\n")
