"""Faults injected into real processes: crashes, outages, hostile input, full disks."""
