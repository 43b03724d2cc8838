"""Datasets: prepare.py writes them (also runnable as a script), loader.py reads them."""
