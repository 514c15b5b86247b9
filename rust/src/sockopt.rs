//! Integer socket options the standard library and tokio do not set.

use std::io;
use std::os::fd::RawFd;

/// Sets option `name` at `level` of the socket `fd` to `value`.
pub(crate) fn set_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: usize,
) -> io::Result<()> {
    let value = libc::c_int::try_from(value).unwrap_or(libc::c_int::MAX);
    // SAFETY: `value` is a c_int that lives across the call, and its length is given;
    // a descriptor that is not an open socket only makes the call fail.
    let done = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if done == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
