"""`wattserve attach`: the controller, device layer and front API over an unmodified vLLM or
SGLang server, read through its Prometheus /metrics. Nothing here serves tokens itself."""
