"""Planning of allocations: namespaces, veths, addresses, routes and port maps (pure).

``plan.plan_allocs`` is the entry; ``ipam`` keeps addresses and host ports from
the live state, ``neighbours`` the MACs and the bridges' neighbour entries,
``live`` reads what the live state says of one allocation.
"""
