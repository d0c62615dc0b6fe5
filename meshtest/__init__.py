"""Development helpers shared by the tests, the demo and the benchmarks: never part of the product.

meshtest.harness runs a real mesh-runtime in a subprocess and talks to it the way model-mesh
does. It lives outside tests/ so that scripts/ and bench/ import it like any package, and
outside setup.cfg's packages so that the image does not ship it.
"""
