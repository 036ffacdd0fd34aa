"""The cost report of served traffic: measured inputs, hosted and self-built costs, the recommendation, the page."""
