import com.taobao.metamorphosis.Message;
import com.taobao.metamorphosis.client.MetaClientConfig;
import com.taobao.metamorphosis.client.MetaMessageSessionFactory;
import com.taobao.metamorphosis.client.XAMetaMessageSessionFactory;
import com.taobao.metamorphosis.client.producer.SendResult;
import com.taobao.metamorphosis.utils.ZkUtils;

/**
 * Shared by the interop programs: the client configuration and the one-line-per-event
 * output the Python tests read (stdout carries only these lines; log4j writes to stderr).
 */
final class Interop {
    private Interop() {
    }

    /** A client config for {@code zkConnect} (host:port[/chroot]) with Metaq's root /meta. */
    static MetaClientConfig config(String zkConnect) {
        MetaClientConfig cfg = new MetaClientConfig();
        ZkUtils.ZKConfig zk = new ZkUtils.ZKConfig();
        zk.zkConnect = zkConnect;
        zk.zkRoot = "/meta";
        zk.zkSessionTimeoutMs = 10000;
        zk.zkConnectionTimeoutMs = 10000;
        cfg.setZkConfig(zk);
        return cfg;
    }

    static MetaMessageSessionFactory factory(String zkConnect) throws Exception {
        return new MetaMessageSessionFactory(config(zkConnect));
    }

    static XAMetaMessageSessionFactory xaFactory(String zkConnect) throws Exception {
        return new XAMetaMessageSessionFactory(config(zkConnect));
    }

    /** One event line, flushed at once (the tests wait on these). */
    static synchronized void out(String line) {
        System.out.println(line);
        System.out.flush();
    }

    /**
     * SENT <partition> <offset> <msgId> <body>, or FAILED <body> <error>; the body is the
     * message's data as text (the tests send ASCII without blanks).
     */
    static void sent(SendResult r, Message m) {
        String body = new String(m.getData(), java.nio.charset.StandardCharsets.UTF_8);
        if (r.isSuccess()) {
            out("SENT " + r.getPartition() + " " + r.getOffset() + " " + m.getId() + " " + body);
        } else {
            out("FAILED " + body + " " + oneLine(r.getErrorMessage()));
        }
    }

    /** ERROR <class>: <message> (causes joined with " <- "), on one line. */
    static void error(Throwable t) {
        StringBuilder sb = new StringBuilder("ERROR ");
        for (Throwable c = t; c != null; c = c.getCause() == c ? null : c.getCause()) {
            if (c != t) {
                sb.append(" <- ");
            }
            sb.append(c.getClass().getName()).append(": ").append(oneLine(c.getMessage()));
            if (c instanceof javax.transaction.xa.XAException) {
                sb.append(" [errorCode=").append(((javax.transaction.xa.XAException) c).errorCode).append(']');
            }
        }
        out(sb.toString());
    }

    private static final java.io.BufferedReader STDIN = new java.io.BufferedReader(
            new java.io.InputStreamReader(System.in, java.nio.charset.StandardCharsets.UTF_8));

    /** Blocks until the test writes a line to stdin (or closes it). */
    static void awaitInput() throws java.io.IOException {
        STDIN.readLine();
    }

    static String oneLine(String s) {
        return s == null ? "null" : s.replace("\r", "\\r").replace("\n", "\\n");
    }
}
