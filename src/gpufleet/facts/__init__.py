"""pyinfra facts: pure, typed parsers of what a host reports, tested on output recorded on real hosts."""
