"""Ledger records -> the boards: standings at an instant, `leaderboard.md`, hourly snapshots, the daily
prizes and the plots of the top score over time.

Modules, one per decision: `standings` (entries, states, ranks, each board at every hour, the chain
head), `snapshots` (the hourly files), `prizes` (the daily windows and the final placings), `render`
(leaderboard.md), `plots` (the PNGs); `cli` holds the verbs `board`, `snapshots` and `prizes`. All but
`cli` are pure functions of plain data (the ledger's records, the competition, the problems'
workloads, an instant `now`); only `cli` reads and writes files. Records are ordered by
`accepted_at`, then PR number, then head SHA, never by their place in the ledger, so the order in which
records arrived changes nothing.

The rules, in the order they apply to a board (one per kernel problem, and the serving board):
- A result's state: `disqualified` if its latest marking is a disqualification; else `under_review` if
  its status is needs_review and no clearance credits it; else `organizers` for the organizers' own
  solution (a record with "entrant": "organizers", pipeline/ledger.py), whenever accepted; else
  `out_of_window` if accepted outside its track's window [start, end); else `ranked`. Only `ranked`
  results are ranked, hold a board, appear in a snapshot or win a prize: the organizers' best result is
  shown on its kernel board beside the baseline, unranked, so a competitor below it still holds the
  board. Markings apply retroactively: a disqualified result is taken out of every standing, past hours
  included (the snapshots are refreshed), and a cleared one is credited from its own accepted_at.
- A board at instant T ranks each competitor's best `ranked` result accepted at or before T: the
  highest score (a kernel board: the geometric mean of the workloads' speedups; the serving board: S,
  which its result restates as score.speedup), the earlier accepted on equal scores.
- Ties: walking down in score order, the first entry not yet placed leads a rank group; every following
  entry whose 95% interval (score.interval; the point score when a result has none) overlaps the
  LEADER's interval joins the group. The group shares one rank (its position: 1, 1, 3, ...), and within
  it entries are listed earlier accepted first. The first entry of the first group holds the board.
- Daily windows: every 24 hours (configurable) from a track's start; a window's hours are the hourly
  snapshots in (start, close], so a result accepted exactly at the close counts for that window.
  `top_at_close`: the winner is the holder in the snapshot at the close. `most_hours_on_top`: the
  competitor who held the board in most of the window's snapshots; ties go to whoever held it first.
"""
