"""What the factor families (PVI, EP, BCM, Laplace) say when a fit needs the user's attention:
the texts of their warnings and errors, with the setting to change."""

__all__ = ["ALL_INVALID", "K_ADVICE", "NEVER_APPLIED", "NOT_CHECKED", "Q_BIASED", "Q_UNRELIABLE", "REJECTED",
           "UNCHECKED_FIT"]


ALL_INVALID = (
    "{cls}: in round(s) {rounds} every update that arrived was invalid (an improper cavity, or a local fit "
    "that failed or is not a proper Gaussian), from client(s) {clients}; q did not move. {hint}Use damping < 1, "
    "more local steps, or another tilted/update method"
)


K_ADVICE = (
    "the fitted Gaussian does not hold the tilted distribution's mass (Pareto k of its importance weights above "
    "0.7: skew, heavy tails, a boundary, or a funnel that a Gaussian over the global and local sites cannot follow)",
    "Reparameterise the local sites (numpyro.infer.reparam.LocScaleReparam), or use nf.EP(tilted='laplace'), "
    "which integrates Gaussian local latents out exactly; tilted='nuts' for a non-Gaussian tilted distribution.",
)


UNCHECKED_FIT = (
    "{cls}: {what} on client(s) {clients}, in their latest applied update (round(s) {rounds}; worst {stat_name} = "
    "{stat:.3g}). Those updates are in q, so q may be wrong. {fix}"
)


REJECTED = (
    "{cls}: the server rejected the valid update(s) of round(s) {rounds} (from client(s) {clients}): even with its "
    "damping halved max_halvings={halvings} times, applying it would have left q improper{kl}; q did not move in "
    "those rounds. {fix}"
)


NEVER_APPLIED = (
    "{cls} applied no update in {rounds} round(s): q is still the prior, not a posterior. {why}Use damping < 1, "
    "more local steps, or check the model and data (nf.fit starts from the Laplace approximation)"
)


NOT_CHECKED = (
    "{cls}: q was not checked against the posterior: the model's local latents are not Gaussian given the global "
    "sites, and some client's importance sampling of them (Laplace proposal) failed its own Pareto-k check, so its "
    "term log p(y_j | theta) could flag a right fit or pass a wrong one. The clients' own checks of their local fits "
    "still ran; diagnose() runs the approximate (plain Laplace) check on request"
)


Q_UNRELIABLE = (
    "{cls}: the fitted q is unreliable: Pareto k = {k:.2f} > 0.7 for the importance ratios p(theta, y) / q(theta) "
    "of the global sites (effective sample size {ess:.0f} of {n} draws){local}, so q misses posterior mass and its "
    "means and sds can be far off (a skewed or heavy-tailed posterior in unconstrained space, a funnel, too few "
    "rounds). Check against NUTS (see .diagnose); check_fit=False silences this"
)


Q_BIASED = (
    "{cls}: Pareto k = {k:.2f} is below 0.7, but q's moments disagree with the importance-weighted moments of the "
    "same {n} draws (means more than {mean_margin} weighted sds apart or sds more than {sd_margin:.0%}) at "
    "{sites}{local}: q is biased there (a Gaussian "
    "in unconstrained space whose tails are off shows in user space, or the fit has not converged). Use "
    "sample_posterior(..., corrected=True) / nf.to_arviz(..., corrected=True) for importance-resampled draws, run "
    "more rounds, or check against NUTS; check_fit=False silences this"
)
