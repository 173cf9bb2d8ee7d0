"""Pure rules every kind of job shares: the options a schedule takes besides its timing
(options.py: whom to tell, jitter, overlap, catch-up) and where a job stands and when it
will really fire (states.py). No I/O."""
