"""The reference engine's runs, as `dgw` runs them: the load-ramp demo, the acceptance shift and
the GPU sweep, with the worker variants, the load generator and the toy-run arguments they
share. They drive the engine; the engine never imports them."""
