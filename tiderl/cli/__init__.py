"""The tiderl command line: one module per command group."""
