"""Where elements come from: arrays and memmaps, ranges, generators, files."""
