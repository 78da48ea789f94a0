"""Pure decision logic: values in, values out, an explicit `now`; no I/O of any kind."""
