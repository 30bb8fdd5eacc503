"""The reference engine's runs, as `dgw` runs them: the load-ramp demo, the acceptance shift and
the GPU sweep, with the worker variants, the load generator and the toy-run arguments they
share. Tools import the engines and the core; neither imports them."""
