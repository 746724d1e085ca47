"""The course floor: what the notebooks share. Exercises, teaching kernels and
hard-path defaults (course, teach), the checks that grade an answer (grading) and the
worked solutions (solutions), design reviews (review, and the configuration they review:
reviewed), and the parameters every notebook validates (run).

Not here: the notebooks (notebooks/), their figures (mk.plots).
"""
