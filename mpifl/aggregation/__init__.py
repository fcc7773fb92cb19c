"""aggregation"""
