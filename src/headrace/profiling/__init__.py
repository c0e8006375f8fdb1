"""Where memory and time go: process memory, per-stage bookings, throughput."""
