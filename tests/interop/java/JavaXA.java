import com.taobao.metamorphosis.Message;
import com.taobao.metamorphosis.client.XAMetaMessageSessionFactory;
import com.taobao.metamorphosis.client.producer.SendResult;
import com.taobao.metamorphosis.client.producer.XAMessageProducer;
import com.taobao.metamorphosis.transaction.XATransactionId;

import java.nio.charset.StandardCharsets;
import java.util.Arrays;

import javax.transaction.xa.XAResource;
import javax.transaction.xa.Xid;

/**
 * Metaq 1.4 XA transactions driven by hand, as a transaction manager would drive them:
 *
 * <pre>JavaXA &lt;zkConnect&gt; &lt;topic&gt; &lt;uniqueQualifier&gt; &lt;op&gt;...</pre>
 *
 * XAMetaMessageSessionFactory → createXAProducer() → setUniqueQualifier(fixed, so a later run
 * finds the branches with recover()) → publish(topic) → getXAResource().  Xids have format id
 * 4660, global id = the gtrid text's bytes and branch qualifier "b1".  Ops:
 * <ul>
 * <li>{@code commit:<gtrid>:<n>}: start, n sendMessage (bodies {@code <gtrid>-<i>}), end(TMSUCCESS),
 *     prepare, commit(xid, false) (two-phase);</li>
 * <li>{@code onephase:<gtrid>:<n>}: start, send, end, commit(xid, true);</li>
 * <li>{@code rollback:<gtrid>:<n>}: start, send, end, prepare, rollback;</li>
 * <li>{@code prepare:<gtrid>:<n>}: start, send, end, prepare, and leave the branch prepared;</li>
 * <li>a {@code :wait} suffix on commit / rollback ({@code commit:<gtrid>:<n>:wait}) prints
 *     {@code AWAITING <gtrid>} after prepare and reads one line from stdin before finishing;</li>
 * <li>{@code recover}: recover(TMSTARTRSCAN | TMENDRSCAN), one {@code RECOVERED <key>} line per xid;</li>
 * <li>{@code commit-recovered} / {@code rollback-recovered}: recover, then commit(xid, false) /
 *     rollback(xid) each;</li>
 * <li>{@code commit-xid:<gtrid>} / {@code rollback-xid:<gtrid>}: commit(xid, false) / rollback(xid)
 *     of a branch prepared earlier (by another run), as a transaction manager does from its own
 *     log after a crash.</li>
 * </ul>
 * Prints {@code STARTED}, {@code SENT ...}, {@code ENDED}, {@code PREPARED <gtrid> <vote>},
 * {@code COMMITTED <gtrid-or-key>}, {@code ROLLEDBACK <...>} as it goes; transaction keys are
 * Metaq's {@code XID:<formatId>:<hex gtrid>:<hex bqual>:<uniqueQualifier>}.  Stops at the first
 * exception ({@code ERROR ...}), prints {@code DONE}, exits 0 or 1.
 */
public class JavaXA {
    static final int FORMAT_ID = 4660;
    static final byte[] BQUAL = "b1".getBytes(StandardCharsets.UTF_8);

    /** A plain Xid (what a transaction manager hands a resource). */
    static final class SimpleXid implements Xid {
        final byte[] gtrid;

        SimpleXid(String gtrid) {
            this.gtrid = gtrid.getBytes(StandardCharsets.UTF_8);
        }

        @Override
        public int getFormatId() {
            return FORMAT_ID;
        }

        @Override
        public byte[] getGlobalTransactionId() {
            return this.gtrid.clone();
        }

        @Override
        public byte[] getBranchQualifier() {
            return BQUAL.clone();
        }

        @Override
        public boolean equals(Object o) {
            return o instanceof SimpleXid && Arrays.equals(((SimpleXid) o).gtrid, this.gtrid);
        }

        @Override
        public int hashCode() {
            return Arrays.hashCode(this.gtrid);
        }
    }

    public static void main(String[] args) throws Exception {
        String zkConnect = args[0];
        String topic = args[1];
        String uniqueQualifier = args[2];
        XAMetaMessageSessionFactory factory = Interop.xaFactory(zkConnect);
        int status = 0;
        try {
            XAMessageProducer producer = factory.createXAProducer();
            producer.setUniqueQualifier(uniqueQualifier);
            producer.publish(topic);
            for (int k = 3; k < args.length; k++) {
                String[] op = args[k].split(":");
                switch (op[0]) {
                case "commit":
                case "onephase":
                case "rollback":
                case "prepare":
                    runBranch(producer, topic, op[0], op[1], Integer.parseInt(op[2]),
                        op.length > 3 && op[3].equals("wait"));
                    break;
                case "commit-xid":
                    producer.getXAResource().commit(new SimpleXid(op[1]), false);
                    Interop.out("COMMITTED " + op[1]);
                    break;
                case "rollback-xid":
                    producer.getXAResource().rollback(new SimpleXid(op[1]));
                    Interop.out("ROLLEDBACK " + op[1]);
                    break;
                case "recover":
                    recover(producer.getXAResource());
                    break;
                case "commit-recovered":
                case "rollback-recovered":
                    for (Xid xid : recover(producer.getXAResource())) {
                        // commit / rollback end the producer's transaction context: ask again.
                        XAResource xares = producer.getXAResource();
                        String key = ((XATransactionId) xid).getTransactionKey();
                        if (op[0].equals("commit-recovered")) {
                            xares.commit(xid, false);
                            Interop.out("COMMITTED " + key);
                        } else {
                            xares.rollback(xid);
                            Interop.out("ROLLEDBACK " + key);
                        }
                    }
                    break;
                default:
                    throw new IllegalArgumentException("unknown op " + args[k]);
                }
            }
            producer.shutdown();
        } catch (Throwable t) {
            Interop.error(t);
            status = 1;
        } finally {
            Interop.out("DONE");
            factory.shutdown();
        }
        System.exit(status);
    }

    static Xid[] recover(XAResource xares) throws Exception {
        Xid[] xids = xares.recover(XAResource.TMSTARTRSCAN | XAResource.TMENDRSCAN);
        for (Xid xid : xids) {
            Interop.out("RECOVERED " + ((XATransactionId) xid).getTransactionKey());
        }
        Interop.out("RECOVER-DONE " + xids.length);
        return xids;
    }

    static void runBranch(XAMessageProducer producer, String topic, String how, String gtrid, int n,
            boolean wait) throws Exception {
        Xid xid = new SimpleXid(gtrid);
        XAResource xares = producer.getXAResource();
        xares.start(xid, XAResource.TMNOFLAGS);
        Interop.out("STARTED " + gtrid);
        for (int i = 0; i < n; i++) {
            Message m = new Message(topic, (gtrid + "-" + i).getBytes(StandardCharsets.UTF_8));
            SendResult r = producer.sendMessage(m);
            Interop.sent(r, m);
            if (!r.isSuccess()) {
                throw new IllegalStateException("send failed: " + r.getErrorMessage());
            }
        }
        xares.end(xid, XAResource.TMSUCCESS);
        Interop.out("ENDED " + gtrid);
        if (how.equals("onephase")) {
            xares.commit(xid, true);
            Interop.out("COMMITTED " + gtrid);
            return;
        }
        int vote = xares.prepare(xid);
        Interop.out("PREPARED " + gtrid + " " + vote);
        if (wait) {
            Interop.out("AWAITING " + gtrid);
            Interop.awaitInput();
        }
        if (how.equals("commit")) {
            xares.commit(xid, false);
            Interop.out("COMMITTED " + gtrid);
        } else if (how.equals("rollback")) {
            xares.rollback(xid);
            Interop.out("ROLLEDBACK " + gtrid);
        }
    }
}
