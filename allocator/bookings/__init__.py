"""Bookings: a guarantee of GPUs to a group (or a list of users) for a window of time, one-off
or weekly, in a time zone an admin names ("CS101 gets 15 GPUs on Tuesdays 10:00-12:00,
Europe/Berlin, until the end of term").

The policy core, pure like :mod:`allocator.placement.policy`: plain data in and out, no I/O, no
clock (``now`` and ``t`` are passed in). One concept per module; which module holds which:
docs/design.md, "Module map".
"""
