"""One run: resolve the request, start a placement, watch it, read the doctor, return the Result; steering."""
