package dev.sidecar.spring;

import dev.sidecar.client.SidecarClient;
import dev.sidecar.client.SidecarClientBuilder;
import io.micrometer.core.instrument.binder.grpc.ObservationGrpcClientInterceptor;
import io.micrometer.observation.ObservationRegistry;
import java.nio.file.Path;
import java.time.Duration;
import org.springframework.ai.chat.observation.ChatModelObservationConvention;
import org.springframework.ai.embedding.observation.EmbeddingModelObservationConvention;
import org.springframework.ai.model.SpringAIModelProperties;
import org.springframework.ai.model.tool.ToolCallingManager;
import org.springframework.beans.factory.ObjectProvider;
import org.springframework.boot.health.autoconfigure.contributor.ConditionalOnEnabledHealthIndicator;
import org.springframework.boot.health.contributor.HealthIndicator;
import org.springframework.boot.autoconfigure.AutoConfiguration;
import org.springframework.boot.autoconfigure.condition.AnyNestedCondition;
import org.springframework.boot.autoconfigure.condition.ConditionalOnBean;
import org.springframework.boot.autoconfigure.condition.ConditionalOnClass;
import org.springframework.boot.autoconfigure.condition.ConditionalOnMissingBean;
import org.springframework.boot.autoconfigure.condition.ConditionalOnProperty;
import org.springframework.boot.context.properties.EnableConfigurationProperties;
import org.springframework.context.annotation.Bean;
import org.springframework.context.annotation.Conditional;
import org.springframework.context.annotation.Configuration;

/**
 * Auto-configures a {@link SidecarClient} from {@code sidecar.client.*}, the Spring AI
 * {@link SidecarChatModel} and {@link SidecarEmbeddingModel}, an actuator health indicator
 * and gRPC client observation. Model selection follows Spring AI's own starters: the chat
 * model exists when {@code spring.ai.model.chat} is {@code sidecar} or unset, the embedding
 * model when {@code spring.ai.model.embedding} is; the client, health indicator and the
 * rest exist only when at least one of the two is selected, so an application that picks
 * another provider for both gets no sidecar beans. Every bean backs off when the
 * application defines its own; user {@link ChatModelObservationConvention} /
 * {@link EmbeddingModelObservationConvention} beans are applied, and so is a unique
 * {@link ToolCallingManager} bean (it resolves tool callbacks to the definitions sent). Runs before Spring AI's
 * ChatClient auto-configuration, whose {@code ChatClient.Builder} then wraps the chat model.
 */
@AutoConfiguration(
        afterName = "org.springframework.boot.micrometer.observation.autoconfigure.ObservationAutoConfiguration",
        beforeName = "org.springframework.ai.model.chat.client.autoconfigure.ChatClientAutoConfiguration")
@ConditionalOnClass(SidecarClient.class)
@Conditional(SidecarAutoConfiguration.SidecarModelSelected.class)
@EnableConfigurationProperties(SidecarProperties.class)
public class SidecarAutoConfiguration {

    /** True when {@code spring.ai.model.chat} or {@code spring.ai.model.embedding} selects the sidecar (or is unset). */
    static final class SidecarModelSelected extends AnyNestedCondition {

        SidecarModelSelected() {
            super(ConfigurationPhase.PARSE_CONFIGURATION);
        }

        @ConditionalOnProperty(name = SpringAIModelProperties.CHAT_MODEL, havingValue = SidecarChatModel.PROVIDER,
                matchIfMissing = true)
        static final class Chat {
        }

        @ConditionalOnProperty(name = SpringAIModelProperties.EMBEDDING_MODEL,
                havingValue = SidecarChatModel.PROVIDER, matchIfMissing = true)
        static final class Embedding {
        }
    }

    @Bean(destroyMethod = "close")
    @ConditionalOnMissingBean
    public SidecarClient sidecarClient(SidecarProperties props, ObjectProvider<SidecarClientCustomizer> customizers) {
        SidecarClientBuilder b = SidecarClient.builder()
                .target(props.getTarget())
                .apiKey(props.getApiKey())
                .tls(props.isTls())
                .maxRetryAttempts(props.getMaxRetryAttempts())
                .maxInboundMessageSize(maxMessageBytes(props))
                .keepAlive(positive(props.getKeepAliveTime()), positive(props.getKeepAliveTimeout()))
                .keepAliveWithoutCalls(props.isKeepAliveWithoutCalls())
                .idleTimeout(positive(props.getIdleTimeout()))
                .healthCheck(props.isHealthCheck())
                .loadBalancingPolicy(props.getLoadBalancingPolicy())
                .defaultDeadline(positive(props.getDeadline()))
                .defaultStreamDeadline(positive(props.getStreamDeadline()));
        if (props.getTrustCertificates() != null && !props.getTrustCertificates().isBlank()) {
            b.trustedCertificates(Path.of(props.getTrustCertificates()));
        }
        customizers.orderedStream().forEach(c -> c.customize(b));
        return b.build();
    }

    private static Duration positive(Duration d) {
        return d == null || d.isZero() || d.isNegative() ? null : d;
    }

    private static int maxMessageBytes(SidecarProperties props) {
        long bytes = props.getMaxMessageSize() == null ? -1 : props.getMaxMessageSize().toBytes();
        if (bytes <= 0 || bytes > Integer.MAX_VALUE) {
            throw new IllegalArgumentException(SidecarProperties.PREFIX
                    + ".max-message-size: must be between 1B and 2GB, got " + props.getMaxMessageSize());
        }
        return (int) bytes;
    }

    @Bean
    @ConditionalOnMissingBean
    @ConditionalOnProperty(name = SpringAIModelProperties.CHAT_MODEL, havingValue = SidecarChatModel.PROVIDER,
            matchIfMissing = true)
    public SidecarChatModel sidecarChatModel(SidecarClient client, SidecarProperties props,
                                             ObjectProvider<ObservationRegistry> observationRegistry,
                                             ObjectProvider<ChatModelObservationConvention> convention,
                                             ObjectProvider<ToolCallingManager> toolCallingManager) {
        return SidecarChatModel.builder()
                .client(client)
                .defaultOptions(props.getChat().toOptions())
                .observationRegistry(observationRegistry.getIfUnique(() -> ObservationRegistry.NOOP))
                .toolCallingManager(toolCallingManager.getIfUnique())
                .observationConvention(convention.getIfAvailable())
                .build();
    }

    @Bean
    @ConditionalOnMissingBean
    @ConditionalOnProperty(name = SpringAIModelProperties.EMBEDDING_MODEL, havingValue = SidecarChatModel.PROVIDER,
            matchIfMissing = true)
    public SidecarEmbeddingModel sidecarEmbeddingModel(SidecarClient client,
                                                       ObjectProvider<ObservationRegistry> observationRegistry,
                                                       ObjectProvider<EmbeddingModelObservationConvention> convention) {
        SidecarEmbeddingModel model = new SidecarEmbeddingModel(client,
                observationRegistry.getIfUnique(() -> ObservationRegistry.NOOP));
        convention.ifAvailable(model::setObservationConvention);
        return model;
    }

    /** Observes every gRPC call of the client (timer + trace span per RPC). */
    @Configuration(proxyBeanMethods = false)
    @ConditionalOnClass({ObservationGrpcClientInterceptor.class, ObservationRegistry.class})
    @ConditionalOnBean(ObservationRegistry.class)
    static class ObservationConfiguration {

        @Bean
        SidecarClientCustomizer sidecarObservationCustomizer(ObservationRegistry registry) {
            return builder -> builder.interceptor(new ObservationGrpcClientInterceptor(registry));
        }
    }

    @Configuration(proxyBeanMethods = false)
    @ConditionalOnClass({HealthIndicator.class, ConditionalOnEnabledHealthIndicator.class})
    @ConditionalOnEnabledHealthIndicator("sidecar")
    static class HealthConfiguration {

        @Bean
        @ConditionalOnMissingBean(name = "sidecarHealthIndicator")
        SidecarHealthIndicator sidecarHealthIndicator(SidecarClient client, SidecarProperties props) {
            return new SidecarHealthIndicator(client, props.getHealthTimeout());
        }
    }
}
