"""recorders"""
