//! The file descriptors a listener needs for the connections it admits.
//!
//! Every connection is a descriptor, and a process starts with the soft limit its
//! parent gave it: often 1,024, far below the 22,756 connections a lighthouse admits
//! for 10,000 groups. A process may raise its soft limit up to its hard limit without
//! privileges, so the lighthouse does that at start; past the hard limit only the
//! operator can help (`ulimit -Hn`, systemd's `LimitNOFILE=`, `docker run --ulimit`), and
//! the lighthouse says so, with how many groups it can carry meanwhile, instead of
//! failing accepts with EMFILE once the job grows.
//!
//! `plan` is the rule (pure); `ensure` reads and sets the limit.

/// Descriptors a listener holds besides its connections: its sockets, the runtime's
/// epoll and wakers, log and state files, a peer's client channels.
pub const BESIDES_CONNECTIONS: u64 = 128;

/// What to do about the descriptor limit, given the current `soft` and `hard` limits
/// and the descriptors `needed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// The soft limit covers it.
    Enough,
    /// Raise the soft limit to this (at most the hard limit), which covers it.
    Raise(u64),
    /// Raise the soft limit to the hard limit, which still falls short of `needed`.
    Short { raise_to: u64, needed: u64 },
}

pub fn plan(soft: u64, hard: u64, needed: u64) -> Plan {
    if soft >= needed {
        Plan::Enough
    } else if hard >= needed {
        Plan::Raise(needed)
    } else {
        Plan::Short {
            raise_to: hard,
            needed,
        }
    }
}

/// Makes room for `connections` connections; returns a warning when the hard limit
/// does not allow them, naming how many fit and the fix. `what` names the flag that
/// set the number (e.g. "--max-groups 10000").
pub fn ensure(connections: usize, what: &str) -> Option<String> {
    let needed = connections as u64 + BESIDES_CONNECTIONS;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given, which lives on this stack.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Some(format!(
            "cannot read this process's file-descriptor limit ({}); the lighthouse may \
             refuse connections below {what}",
            std::io::Error::last_os_error()
        ));
    }
    let (soft, hard) = (limit.rlim_cur, limit.rlim_max);
    let raise_to = match plan(soft, hard, needed) {
        Plan::Enough => return None,
        Plan::Raise(to) | Plan::Short { raise_to: to, .. } => to,
    };
    let raised = libc::rlimit {
        rlim_cur: raise_to,
        rlim_max: limit.rlim_max,
    };
    // SAFETY: setrlimit reads the struct it is given.
    let set = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0;
    let now = if set { raise_to } else { soft };
    if now >= needed {
        tracing::info!("raised the file-descriptor limit from {soft} to {now} for {what}");
        return None;
    }
    let fit = now.saturating_sub(BESIDES_CONNECTIONS);
    Some(format!(
        "this process may open {now} files (hard limit {hard}), but {what} need {needed}: \
         it accepts about {fit} connections, one per group. Raise the hard limit (ulimit \
         -Hn {needed} as root, LimitNOFILE={needed} in a systemd unit, docker run --ulimit \
         nofile={needed}) or lower the number"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_raised_only_as_far_as_needed_and_never_past_the_hard_one() {
        assert_eq!(plan(20_000, 20_000, 12_884), Plan::Enough);
        assert_eq!(plan(1024, 1_048_576, 12_884), Plan::Raise(12_884));
        assert_eq!(
            plan(1024, 4096, 12_884),
            Plan::Short {
                raise_to: 4096,
                needed: 12_884
            }
        );
    }

    #[test]
    fn a_need_within_the_limit_asks_nothing() {
        assert_eq!(ensure(16, "--max-groups 16"), None);
    }
}
