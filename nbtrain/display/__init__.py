"""Renders what the ranks report: widgets in Jupyter, text elsewhere."""
