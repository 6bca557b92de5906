"""canaries"""
