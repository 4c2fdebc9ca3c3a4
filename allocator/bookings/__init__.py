"""Bookings: a guarantee of GPUs to a group (or a list of users) for a window of time, one-off
or weekly, in a time zone an admin names ("CS101 gets 15 GPUs on Tuesdays 10:00-12:00,
Europe/Berlin, until the end of term").

The policy core, pure like :mod:`allocator.placement.policy`: plain data in and out, no I/O, no
clock (``now`` and ``t`` are passed in). One concept per module:

* :mod:`allocator.bookings.booking`: a booking as data (strict pydantic models), its error
  codes, and reading one from a request's body;
* :mod:`allocator.bookings.windows`: a booking's occurrences in UTC, and what a local time
  means on the day the clocks change;
* :mod:`allocator.bookings.checks`: a booking checked against the clock and the cluster
  (groups, models, hosts, GPUs), its model resolved;
* :mod:`allocator.bookings.supply`: the GPUs bookings draw on, and what each booking active at
  one instant can be given of them;
* :mod:`allocator.bookings.admission`: whether a new booking fits next to the others, and if
  not, what collides and what would fit;
* :mod:`allocator.bookings.shortfall`: which occurrences are short after GPUs went away;
* :mod:`allocator.bookings.guarantees`: the guarantees bookings give at one instant.
"""
