"""State shared by every gateway process of one validator, on one machine or several, through Redis.

One gateway process relays about 15,000 tokens a second per core; a validator that takes its share of a
busy subnet outgrows it (issue 28). N processes (``--gateway.workers``, or gateways on other machines)
each route and relay on their own, and what must hold subnet-wide lives in one Redis server:

* :mod:`.leases`: each miner's requests in flight, as leases that expire, so weighted-random least-in-flight and
  each miner's declared slots hold across processes, and a killed process's leases free themselves;
* :mod:`.limits`: per-API-key limits and budgets, each admission one atomic script;
* :mod:`.measurements`: every measurement (and answer kept for audit) on a Redis Stream, read by the one
  scorer through a consumer group and acknowledged only once the round holding it is saved;
* :mod:`.routing`: the scorer's view of the metagraph (members, scores, quarantine, offers), published for the
  gateways to route by.

Redis down is never the client's problem nor the miner's: routing goes on with local counts, limits fall back to
a local share of each limit, measurements wait in a bounded local buffer. :mod:`.link` says so once, not per
request. Without ``--redis.url`` none of this exists and one process holds everything, as before.
"""
