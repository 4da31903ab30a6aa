"""kspipe's own tests (a package, so that they import the helpers of :mod:`tests.kit`)."""
